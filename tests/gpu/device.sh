#!/usr/bin/env bash
# make test-gpu on a lent GPU machine that has its own CUDA build of torch (a python3 that holds PyTorch) but
# not mlscale's other dependencies, and cannot download: they come as wheels in WHEELS (made on a machine that
# can, for the GPU host's Python, e.g. `pip download --python-version 3.12 --only-binary=:all: --platform
# manylinux2014_x86_64 -d .gpu-wheels pydantic sqlalchemy starlette 'uvicorn[standard]' orjson protobuf==6.33.6`).
# mlscale runs from the checkout (PYTHONPATH), as the tests run it. Output: OUT/gpu.log and the benchmark files.
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.gpu-wheels}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "cores: $(nproc)"
    python3 -m pip install -q --no-index --find-links "$WHEELS" pydantic sqlalchemy starlette 'uvicorn[standard]' \
        orjson 'protobuf==6.33.6' 2>&1 | grep -v -i warning | tail -3
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'device(s)')"
    # the quick checks first, then the serving benchmark (minutes): a limit reached there loses nothing else
    timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/gpu -k "not serving"
    echo "pytest exit $?"
    timeout "${SERVE_TESTS_S:-200}" python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/gpu -k serving
    echo "pytest (serving) exit $?"
} 2>&1 | tee "$OUT/gpu.log"
if [ -n "${BENCH_DATA:-}" ]; then  # the loaders on a host with many cores: mlscale vs torch's DataLoader
    timeout "${BENCH_DATA_S:-150}" python3 -m mlscale bench data $BENCH_DATA --out "$OUT" 2>&1 | tail -30 \
        | tee -a "$OUT/gpu.log"
fi
