"""What a Param-Share holder process is told, and how an instance waits for the shared weights' handles:
the contract between the node's bookkeeping (:mod:`orchestrator.node.param_share`), its holder process
(:mod:`orchestrator.worker.param_holder`) and the instances that map the weights. Torch-free."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

#: The module a holder process runs (``python -m``).
HOLDER_MODULE = "orchestrator.worker.param_holder"
#: The environment variable that carries a holder's :class:`HolderSpec` (JSON).
ENV_HOLDER = "GPUPRIMS_PARAM_HOLDER"
#: A holder that failed writes its reason beside the handles' path, with this suffix, so the
#: instances waiting for the handles fail with it instead of waiting out their deadline.
ERROR_SUFFIX = ".error"
#: How long an importer waits for the shared weights' handles to be written (a CUDA holder loading
#: them on a busy machine). Torch-free: the model-file runner waits with it too.
HANDLES_WAIT_S = 600.0


def await_handles(path: str, timeout_s: float = HANDLES_WAIT_S) -> bytes:
    """The shared weights' handles at ``path`` once their exporter or holder has written them (it writes
    atomically). Raises RuntimeError with the holder's reason if it failed (``<path>.error``), and
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            pass
        try:
            with open(path + ERROR_SUFFIX, encoding="utf-8") as f:
                raise RuntimeError(f"the holder of the shared weights {path} failed: {f.read()}")
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared weights' handles {path} were not written within {timeout_s:.0f} s")
        time.sleep(0.01)


@dataclass(frozen=True)
class HolderSpec:
    """What a holder loads and where it writes the handles."""

    key: str
    model: str
    seed: int
    num_classes: int | None  # None: the model's own
    input_shape: tuple[int, ...]
    gpu: int
    path: str

    def to_json(self) -> str:
        """Serialise for the holder's environment (:data:`ENV_HOLDER`)."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> HolderSpec:
        """Parse :meth:`to_json` output; ValueError names what is wrong."""
        try:
            doc = json.loads(text)
            classes = doc["num_classes"]
            return cls(str(doc["key"]), str(doc["model"]), int(doc["seed"]), None if classes is None else int(classes),
                       tuple(int(x) for x in doc["input_shape"]), int(doc["gpu"]), str(doc["path"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed {ENV_HOLDER}: {e}") from None
