#!/usr/bin/env bash
# Rebuilds and reinstalls the native extension into the current Python (developer loop).
# Serialised with a lock so concurrent rebuilds do not trample the shared build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/gpuprims-build.lock "${PYTHON:-python3}" -m pip install -q --no-build-isolation --no-deps -e .
