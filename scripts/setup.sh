#!/usr/bin/env bash
# Make the current python3 ready to run the lab from this checkout (use a virtual environment
# unless this python is yours to change: see the README's "Two commands").
# - Everything already importable (the GPU machine's image, a second run): installs nothing.
# - No NVIDIA GPU: takes the CPU build of torch from PyTorch's CPU index (PyPI's Linux torch is
#   the CUDA build, about 5.7 GB with its libraries; pinned: the lab's CI machine keeps that wheel
#   on disk), then the rest of the dependencies.
# - With a GPU: also CuPy, for the CUDA major version torch was built with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WANT=(torch triton optuna pandas matplotlib tqdm pytest)

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
missing() { for m in "$@"; do $PY -c "import $m" 2>/dev/null || echo "$m"; done; }

if have_gpu; then
    WANT+=(cupy)  # the raw-CUDA twin; without a GPU nothing could run it
fi
if [ -z "$(missing "${WANT[@]}")" ]; then
    exit 0
fi
echo "setup: installing what is missing: $(missing "${WANT[@]}" | tr '\n' ' ')"
if ! $PY -c "import torch" 2>/dev/null && ! have_gpu; then
    $PY -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
EXTRAS="dev"
if have_gpu; then
    cuda_major=$($PY -c "import torch; print((torch.version.cuda or '13').split('.')[0])")
    EXTRAS="dev,cuda${cuda_major}"
fi
$PY -m pip install -q -e ".[${EXTRAS}]"
