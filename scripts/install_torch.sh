#!/usr/bin/env bash
# Install PyTorch into the active Python environment without ever pulling the CUDA build on a CPU machine.
#   - torch already importable      -> keep it (your own CUDA/ROCm/CPU build stays).
#   - an NVIDIA GPU is visible      -> plain `pip install torch` (the CUDA build, as usual).
#   - otherwise                     -> the CPU build: torch==$TORCH_VERSION+cpu (from a local wheel
#                                      directory pip is configured with, else PyTorch's CPU index).
set -euo pipefail
PY=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

if "$PY" -c "import torch" 2>/dev/null; then
  echo "install_torch: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "install_torch: NVIDIA GPU found, installing the default (CUDA) torch build"
  "$PY" -m pip install "torch>=2.1"
  exit 0
fi
echo "install_torch: no GPU, installing the CPU build of torch ${TORCH_VERSION}"
"$PY" -m pip install "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
  || "$PY" -m pip install "torch==${TORCH_VERSION}" --index-url "$CPU_INDEX" \
  || "$PY" -m pip install torch --index-url "$CPU_INDEX"
