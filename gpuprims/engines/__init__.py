"""Engines: the model runner behind an instance's run seam, one kind per module behind one interface
(:class:`Engine`: check, prepare, run, describe), built once and cached (:mod:`gpuprims.engines.cache`).

Usable from a custom app the way ``sync_lite`` is::

    from gpuprims.engines import ModelSource, Target, make_engine
    eng = make_engine("eager", ModelSource("mobilenet_v2", (3, 64, 64), max_batch=4), Target("cpu"))
    eng.prepare()
    out = eng.run(batch)

Importing this package imports neither torch nor any engine library.
"""

from __future__ import annotations

from gpuprims.engines.base import (
    BACKENDS,
    KINDS,
    BuildInfo,
    Engine,
    EngineError,
    EngineUnavailable,
    ExportError,
    ModelSource,
    Progress,
    Target,
    check_engine,
    engine_class,
    make_engine,
)
from gpuprims.engines.cache import CacheEntry, EngineCache, default_root, fingerprint

__all__ = [
    "BACKENDS",
    "KINDS",
    "BuildInfo",
    "CacheEntry",
    "Engine",
    "EngineCache",
    "EngineError",
    "EngineUnavailable",
    "ExportError",
    "ModelSource",
    "Progress",
    "Target",
    "check_engine",
    "default_root",
    "engine_class",
    "fingerprint",
    "make_engine",
]
