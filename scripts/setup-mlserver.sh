#!/usr/bin/env bash
# MLServer's own environment for bench/peer's `mlserver` row: makes .venv-mlserver (or
# $GPUPRIMS_MLSERVER_VENV) from bench/requirements-mlserver.txt and checks that MLServer's inference worker
# can import the bench's model class (bench.peer_mlserver) from this source tree. Never run by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPUPRIMS_MLSERVER_VENV:-.venv-mlserver}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r bench/requirements-mlserver.txt
PYTHONPATH=. "$VENV/bin/python" -c "import bench.peer_mlserver, mlserver; print('mlserver', mlserver.__version__, 'ok in', '$VENV')"
