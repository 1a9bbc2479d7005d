"""The CLI's tests run nodes whose control socket lives in ``$XDG_RUNTIME_DIR/gpuprims/run-XXXXXXXX/``
under the test's directory. A Unix socket's path is limited to 107 bytes, and pytest's own ``tmp_path``
(``/tmp/pytest-of-USER/pytest-N/popen-gwK/<test name, 30 chars>0/``) leaves too little of that under
pytest-xdist, so these tests get a short private directory instead."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A private directory of about 20 bytes' path (``/tmp/gpcli-XXXXXXXX``), removed after the test."""
    d = Path(tempfile.mkdtemp(prefix="gpcli-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
