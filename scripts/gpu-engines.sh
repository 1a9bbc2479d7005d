#!/usr/bin/env bash
# The GPU engines on a GPU host in one run (docs/gpu-machine.md step 4): builds eager, cudagraph,
# tensorrt fp32/fp16 and ONNX Runtime's CUDA/TensorRT providers on the zoo models, checks each against
# eager at batch 1 and max batch, times them, and writes bench/results/<gpu>/engines_gpu.json.
# Arguments pass through to `python3 -m bench.engines_gpu` (--quick, --models, --max-batch, --fake...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" -m bench.engines_gpu "$@"
