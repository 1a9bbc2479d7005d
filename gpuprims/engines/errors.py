"""The errors engines raise (here, apart from the engine interface, so the kinds table uses them
without importing it)."""

from __future__ import annotations

__all__ = ["EngineError", "EngineUnavailable", "ExportError"]


class EngineError(ValueError):
    """An engine cannot be made, built or run as configured; the message says why."""


class EngineUnavailable(EngineError):
    """This kind of engine cannot run here: wrong backend, or its library is not installed."""


class ExportError(EngineError):
    """The model does not convert to this engine's format (ONNX export, tracing, capture...)."""
