# The two commands of the README: `make run` (main job) and `make test` (the fast test tier).
PY ?= python3
# One pytest process per core; a module whose tests share one costly fixture stays in one process.
PYTEST = $(PY) -m pytest -q -n auto --dist loadgroup

.PHONY: setup run test test-full test-gpu bench
setup:
	@PYTHON=$(PY) bash scripts/setup.sh

run: setup
	$(PY) -m experiments.quickstart

# Every test file, without the `slow` tests and with a sample of each compile matrix (tests/conftest.py).
test: setup
	$(PYTEST) --fast

# Everything: what CI runs.
test-full: setup
	$(PYTEST)

# On a GPU machine whose image already holds the stack (the H200): no install step; GPU tests run there.
test-gpu:
	$(PYTEST)

# On a GPU: every figure of the README's results section, measured at this commit (experiments.headline).
bench:
	$(PY) -m experiments.headline
