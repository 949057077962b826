# Sourced by the device-call scripts: the repository root as working directory, the carried
# wheels (.whl: Optuna and its dependencies, which the GPU machine's image lacks) installed
# beside it, and both on PYTHONPATH. --upgrade: a warm machine already holds them from a call before.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
