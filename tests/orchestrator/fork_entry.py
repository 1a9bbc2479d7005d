"""Entry points a test fork server runs in its children instead of an instance (test_launcher.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from orchestrator.worker.launch import die_with_parent


def report() -> int:
    """Write what the child sees (its environment, parent, open descriptors) to $FK_OUT; exit $FK_RC."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    Path(os.environ["FK_OUT"]).write_text(json.dumps({"env": dict(os.environ), "ppid": os.getppid(), "fds": fds}))
    return int(os.environ.get("FK_RC", "0"))


def linger() -> int:
    """Sleep until killed (or, as an instance does, SIGTERMed when the server dies); bounded."""
    die_with_parent()
    Path(os.environ["FK_OUT"]).write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def imports() -> int:
    """Write which heavy libraries the child holds (in sys.modules, and libtorch among its mappings) to
    $FK_OUT: what it got from its fork server."""
    with open("/proc/self/maps") as f:
        libtorch = "libtorch" in f.read()
    held = sorted(m for m in ("torch", "onnxruntime", "numpy", "apps.zoo", "openvino") if m in sys.modules)
    Path(os.environ["FK_OUT"]).write_text(json.dumps({"modules": held, "libtorch": libtorch}))
    return 0
