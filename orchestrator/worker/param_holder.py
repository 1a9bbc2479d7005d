"""A Param-Share holder process (CUDA): owns one shared copy of an app's weights for the node.

``python -m orchestrator.worker.param_holder`` with ``GPUPRIMS_PARAM_HOLDER`` set to a
:class:`orchestrator.node.param_share.HolderSpec`: loads the model onto the spec's GPU, moves its weights
into one ``cudaMalloc`` arena and exports it (:func:`gpuprims.cuda.ipc.export_parameters`), writes the
handles to the spec's path (atomically: readers never see a partial file), and then only waits, so the
arena lives for as long as the node wants it (orchestrator/node/param_share.py says why a holder). It runs
no kernels after the copy. It exits on SIGTERM (the node stops it once every instance that mapped the
arena is gone) and when the node dies (PR_SET_PDEATHSIG and a parent check). A failure to load or
export is written beside the path (``<path>.error``) so the instances waiting for the handles fail with
the reason instead of waiting out their deadline.

On the fake CUDA runtime the model is on the CPU and the arena is fake device memory exported with the
fake's IPC, so the node's tests run the same lifetimes.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from types import FrameType

import torch

from apps.zoo import load_model
from gpuprims.cuda.ipc import export_parameters
from gpuprims.gather import torch_device
from orchestrator.control.share_spec import ENV_HOLDER, ERROR_SUFFIX, HolderSpec
from orchestrator.worker.launch import die_with_parent, exit_now

log = logging.getLogger("gpuprims.param_holder")

#: How often the holder checks that the node is still its parent while it waits.
PARENT_CHECK_S = 1.0


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def hold(spec: HolderSpec, stop: threading.Event, parent: int) -> None:
    """Load, export and write the handles of ``spec``'s weights, then keep them until ``stop`` is set
    or ``parent`` is no longer this process's parent."""
    device = torch_device("cuda", spec.gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_model(spec.model, seed=spec.seed, num_classes=spec.num_classes,
                       input_shape=spec.input_shape).to(device).eval()
    exported = export_parameters(model, backend="cuda", gpu=spec.gpu)
    _write_atomically(spec.path, exported.to_bytes())
    log.info("holding the shared weights %s (%.1f MiB) on GPU %d, handles %s", spec.key,
             exported.handles.nbytes / 2**20, spec.gpu, spec.path)
    while not stop.wait(PARENT_CHECK_S):
        if os.getppid() != parent:
            log.error("the node died; exiting")
            break
    exported.close()
    del model, exported
    gc.collect()  # frees the arena now (cudaFree), with every instance that mapped it gone


def main() -> int:
    die_with_parent()
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the node's to handle
    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    logging.basicConfig(level=os.environ.get("GPUPRIMS_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s [holder] %(name)s: %(message)s")
    try:
        spec = HolderSpec.from_json(os.environ.get(ENV_HOLDER, ""))
    except ValueError as e:
        log.error("%s", e)
        return 2
    t0 = time.monotonic()
    try:
        hold(spec, stop, parent)
    except Exception as e:  # the waiting instances fail with the reason
        log.exception("cannot hold the shared weights %s", spec.key)
        _write_atomically(spec.path + ERROR_SUFFIX, f"{type(e).__name__}: {e}".encode())
        return 1
    log.info("released the shared weights %s after %.1f s", spec.key, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    exit_now(main())
