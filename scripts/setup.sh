#!/usr/bin/env bash
# Creates .venv (or uses $VENV) and installs gpuprims with its native extension and dev tools.
# torch is pinned to the CPU build this machine type ships; on a GPU machine install torch first
# and use `pip install --no-build-isolation --no-deps -e .` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
"${pip[@]}" "scikit-build-core>=0.10" "nanobind>=2.4"
"${pip[@]}" --no-build-isolation -e ".[dev]"
"$VENV/bin/python" -c "import gpuprims, gpuprims._native as n; print('gpuprims', gpuprims.__version__, 'native ok, CUDA kernels built:', n.CUDA_KERNELS_BUILT)"
