"""Param-Share bookkeeping: which instance exported an app's weights, and where the handles are.

The first instance of a model exports its parameters (CUDA IPC handles on a GPU, shared memory on the
CPU backend) to a file in the run directory; later instances and shadows of the same weights import
that file instead of loading their own copy (paper V-E).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from gpuprims.cuda.ipc import ParameterHandles
from gpuprims.engines import engine_class
from orchestrator.config import AppConfig

log = logging.getLogger("gpuprims.node")


class ParamShare:
    """Exports by weight key (see the module docstring)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.exports: dict[str, dict[str, object]] = {}  # key -> {"path": Path, "exporter": name}

    def key(self, app: AppConfig) -> str | None:
        """Instances with the same key have identical weights and share one copy."""
        if not self.enabled or app.is_dag or not app.model or app.file is not None:
            return None  # (a model file's engine holds its own copy of the weights)
        if not engine_class(app.engine.kind).uses_torch_weights:
            return None  # the engine runs its own copy of the weights (an ONNX session, a plan...)
        return f"{app.model}|{app.seed}|{app.num_classes}|{'x'.join(map(str, app.input_shape))}"

    def exported(self, app: AppConfig) -> bool:
        """True if some instance already exports (or is exporting) this app's weights."""
        key = self.key(app)
        return key is not None and key in self.exports

    def mode_for(self, app: AppConfig, instance: str) -> str | None:
        """The instance's ``share_params``: ``export:PATH`` for the first of its weights, ``import:PATH``
        after that, None when the app does not share."""
        key = self.key(app)
        if key is None:
            return None
        exp = self.exports.get(key)
        if exp is None:
            path = self.run_dir / f"params-{len(self.exports)}.bin"
            self.exports[key] = {"path": path, "exporter": instance}
            return f"export:{path}"
        return f"import:{exp['path']}"

    def exporter_died(self, app: AppConfig, instance: str, backend: str) -> str | None:
        """Called when ``instance`` died. On CUDA, IPC memory dies with its exporter: the export is
        forgotten (the replacement exports anew) and the path importers used is returned, so that the
        caller restarts them rather than let them read freed device memory. None otherwise."""
        key = self.key(app)
        if backend != "cuda" or key is None or self.exports.get(key, {}).get("exporter") != instance:
            return None
        exp = self.exports.pop(key)
        with contextlib.suppress(OSError):
            Path(str(exp["path"])).unlink()
        return f"import:{exp['path']}"

    def remove_all(self) -> None:
        """Remove the exported handles, and the shared-memory objects behind CPU exports (every instance
        is gone by now)."""
        for exp in self.exports.values():
            path = Path(str(exp["path"]))
            with contextlib.suppress(OSError, ValueError):
                h = ParameterHandles.from_bytes(path.read_bytes())
                if h.backend == "cpu":
                    os.unlink("/dev/shm/" + h.handle.decode())
            with contextlib.suppress(OSError):
                path.unlink()
        self.exports.clear()
