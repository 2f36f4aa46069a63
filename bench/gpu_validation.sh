#!/usr/bin/env bash
# The GPU validation on the lent GPU machine (bench/gpu_validation.py says what it runs). That machine has PyTorch,
# transformers, accelerate and peft but not diffusers, pydantic or omegaconf, and no network: bench/gpu_wheels.sh,
# run here beforehand, puts their wheels in .whl/ (ignored by git; name it in the device call's carry).
#   bash bench/gpu_validation.sh [--out DIR] [--families sd3 flux2_klein z_image]
#   bash bench/gpu_validation.sh --dry-run --out /tmp/gv     # the same path on the CPU at tiny size
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flowrl-site .whl/*.whl
    export PYTHONPATH="/tmp/flowrl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 bench/gpu_validation.py "$@"
