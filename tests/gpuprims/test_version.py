"""One version source: gpuprims/_version.py, seen alike by the package metadata and the extension."""

from __future__ import annotations

import importlib.metadata

import gpuprims
from gpuprims import _native


def test_one_version_everywhere() -> None:
    assert _native.__version__ == gpuprims.__version__ == importlib.metadata.version("gpuprims")
