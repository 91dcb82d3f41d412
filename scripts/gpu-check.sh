#!/bin/bash
# The GPU device check (benchmarks/gpu.py) on a machine with a GPU, PyTorch and transformers but no package
# index: the project's other dependencies come as wheels in .whl/ (scripts/gpu-check.sh --fetch-wheels
# downloads them here, where pip works), installed into /tmp/site. Writes $OUT/gpu.json (or ./gpu.json).
#   usage: bash scripts/gpu-check.sh [--fetch-wheels] [benchmarks/gpu.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(annotated-types==0.8.0 blake3==1.0.11 coincurve==21.0.0 outcome==1.3.0.post0 platformdirs==4.14.8
        pycryptodome==3.24.1 pydantic==2.14.4 pydantic_core==2.50.5 sniffio==1.3.1 trio==0.35.0
        typing-inspection==0.4.5 typing_extensions==4.16.0 zstandard==0.25.0)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
    platforms=()
    for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${p}_x86_64")
    done
    for wheel in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d .whl "$wheel"
    done
    exit 0
fi
if [[ -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 benchmarks/gpu.py --out "${OUT:-.}/gpu.json" "$@"
