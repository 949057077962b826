# The two commands of the README: `make run` (main job) and `make test` (the test suite).
PY ?= python3

.PHONY: setup run test test-gpu bench
setup:
	@PYTHON=$(PY) bash scripts/setup.sh

run: setup
	$(PY) -m experiments.quickstart

test: setup
	$(PY) -m pytest -q

# On a GPU machine whose image already holds the stack (the H200): no install step; GPU tests run there.
test-gpu:
	$(PY) -m pytest -q

bench:
	$(PY) -m experiments.bench_kernels
