#!/usr/bin/env bash
# Regenerates the front door's protobuf messages (orchestrator/frontdoor/oip_pb2.py and .pyi) from
# orchestrator/frontdoor/oip.proto with grpcio-tools (dev extra). The generated files are committed,
# so installing gpuprims needs no protoc; tests/orchestrator/frontdoor/test_proto.py checks they match.
# OUT_DIR (default: the source folder) lets that test generate into a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-orchestrator/frontdoor}
"$PY" -m grpc_tools.protoc -I orchestrator/frontdoor --python_out="$OUT_DIR" --pyi_out="$OUT_DIR" \
  orchestrator/frontdoor/oip.proto orchestrator/frontdoor/shm.proto
