#!/usr/bin/env bash
# The GPU path check (benchmarks/gpu_check.py): side-stream snapshot into pinned shared memory (on/off step-time
# ratio, ~1B-parameter model) and NCCL abort + re-init at world size 1. One H200: under 8 minutes with the
# defaults. Run from the repository root on a machine with CUDA: bash benchmarks/gpu_check.sh [gpu_check.py args]
# It installs nothing beyond the repository's own package when torch with CUDA is already importable; otherwise
# it creates .venv-gpu with the default (CUDA) torch wheel of the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    if [ ! -x .venv-gpu/bin/python ]; then
        "$PY" -m venv .venv-gpu
        .venv-gpu/bin/pip install -q "torch==2.13.0" numpy google-crc32c
    fi
    PY=.venv-gpu/bin/python
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec timeout 480 "$PY" benchmarks/gpu_check.py "$@"
