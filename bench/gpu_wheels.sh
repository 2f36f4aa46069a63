#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64, no network): flowrl's dependencies its image lacks, at the versions
# this checkout's .venv runs, into .whl/ (add '/.whl/' to .git/info/exclude once; name .whl in the device call's carry).
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]        # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
NAMES="diffusers pydantic pydantic_core annotated-types typing-inspection omegaconf antlr4-python3-runtime"
mkdir -p .whl
for name in $NAMES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name==$version"
done
ls -la .whl
