"""The serving mode of an instance that serves a model file: requests of named tensors, any shapes.

A :class:`TensorLoop` is the :class:`orchestrator.worker.loops.adaptive.AdaptiveLoop` (the same local queue,
expiry, early drop, batching decision and statistics) with its own batch step. A request's body is a
multi-tensor body (``gpuprims.tensorwire``, wire dtype TENSORS) or, for a model with one input of fixed
dimensions, that input's raw bytes (a v1 body, as the zoo's apps take). Each request is decoded and
checked against the model's signature (a body that does not decode or does not fit is answered
BAD_REQUEST); requests with the same input shapes are stacked into one batch of a batched model
(``max_batch_size`` > 0), a model without batching runs one request at a time; each request is answered
OK with its own outputs as a multi-tensor body.

Exactly once: every request the native queue hands to a batch is answered once here, through
:meth:`ServingLoop.fail` or :meth:`ServingLoop._answer` (each a publication to the answer ring), or, if
the process dies first, by the ingest's reclaim.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from gpuprims.engines import EngineError
from gpuprims.engines.files import batch_groups, split, stack
from gpuprims.pool import ANY_SIZE, RECORD_DTYPE, PacketPool
from gpuprims.tensors import ModelSignature, SignatureError, TensorSpec
from gpuprims.tensorwire import TensorBodyError, decode, encode_arrays
from gpuprims.wire import DType, Status
from orchestrator.control.messages import BatchDone, RunBatch
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.file_runner import FileRunner
from orchestrator.worker.loops.adaptive import AdaptiveLoop
from orchestrator.worker.loops.base import ANSWER_TIMEOUT_US

log = logging.getLogger("gpuprims.instance")


def raw_input(signature: ModelSignature) -> TensorSpec | None:
    """The one input a raw (v1) body may stand for: the model's only required input, when its
    dimensions are all fixed; None otherwise (then only multi-tensor bodies are taken)."""
    required = [s for s in signature.inputs if not s.optional]
    if len(required) != 1 or required[0].fixed_bytes() is None:
        return None
    return required[0]


class TensorLoop(AdaptiveLoop):
    """The serving loop of a model file (see the module docstring)."""

    def __init__(self, spec: InstanceSpec, pool: PacketPool, runner: FileRunner) -> None:
        super().__init__(spec, pool, runner)  # type: ignore[arg-type]
        self.file_runner = runner
        self.signature = runner.signature
        self.raw = raw_input(self.signature)
        ok = [int(DType.TENSORS)]
        if self.raw is not None:
            ok += [int(DType.BYTES)]
            try:
                ok.append(int(DType.from_numpy(self.raw.datatype.numpy)))
            except ValueError:
                pass  # a datatype the v1 header cannot name: raw bodies of it come as BYTES
        self._dtype_ok[:] = False
        self._dtype_ok[ok] = True
        self._dtype_ok_u8 = self._dtype_ok.astype(np.uint8)
        self._body = np.empty(0, np.uint8)  # one request's body, grown as needed

    def attach(self, gatherer: Any) -> None:
        """Nothing to attach: requests are decoded one by one (no fixed-size gather buffer)."""
        self.gatherer = gatherer

    # -- one request's tensors ------------------------------------------------------------------------
    def _tensors(self, rec: int, row: np.ndarray) -> dict[str, np.ndarray]:
        """The request's named tensors (copies), checked against the signature; TensorBodyError or
        SignatureError if it does not decode or fit."""
        n = int(row["total_len"])
        if self._body.size < n:
            self._body = np.empty(max(n, 2 * self._body.size), np.uint8)
        body = self._body[:n]
        if n:
            self.pool.gather(np.array([rec], np.uint32), body.reshape(1, n))
        if int(row["dtype"]) == int(DType.TENSORS):
            tensors = {t.name: np.array(t.array) for t in decode(body)}  # decode refuses a name given twice
        else:
            spec = self.raw
            assert spec is not None
            if n != spec.fixed_bytes():
                raise SignatureError(f"a raw body of {n} bytes is not input {spec.describe()} "
                                     f"({spec.fixed_bytes()} bytes)")
            tensors = {spec.name: body.view(spec.datatype.numpy).reshape(spec.dims).copy()}
        self.signature.check_request(tensors)
        return tensors

    # -- the batch ------------------------------------------------------------------------------------
    def _serve_batch(self, take: int) -> None:
        """Serve the oldest ``take`` queued requests: decode and check each, run each group of equal
        input shapes as one batch (one request at a time without batching), answer each with its outputs."""
        clock = self.stats.stages
        if not clock.running:
            clock.start()
        clock.lap("wait")
        q = self.queue
        n = q.take(take, ANY_SIZE, self._dtype_ok_u8, ANSWER_TIMEOUT_US, self._recs, None)
        if n < take:
            self.stats.counts["error"] += take - n  # answered BAD_REQUEST by take (a dtype no body may have)
        if not n:
            self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
            clock.cancel()
            return
        recs = self._recs[:n].copy()
        info = np.array(q.batch_info(), dtype=RECORD_DTYPE)
        q.clear_batch()  # from here on each request is answered through fail or _answer, once
        requests: list[dict[str, np.ndarray]] = []
        good: list[int] = []
        bad: list[int] = []
        for i in range(n):
            try:
                requests.append(self._tensors(int(recs[i]), info[i]))
                good.append(i)
            except (TensorBodyError, SignatureError, ValueError) as e:
                log.debug("%s: request %d refused: %s", self.spec.name, int(info[i]["request_id"]), e)
                bad.append(i)
        if bad:
            self.fail(recs[bad], info[bad], Status.BAD_REQUEST)
        clock.lap("gather")
        if not good:
            self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
            clock.cancel()
            return
        sig = self.signature
        groups = batch_groups(requests) if sig.batched else [[k] for k in range(len(requests))]
        model_total = 0.0
        for group in groups:
            idx = np.array([good[k] for k in group], np.intp)
            x = stack(requests, group) if sig.batched else requests[group[0]]
            done = self._timed_run(self.file_runner.model, x, "model", recs[idx], info[idx])
            if done is None:
                continue
            out, model_ms = done
            model_total += model_ms
            self.policy.model.observe(len(group), model_ms, at_s=time.monotonic())
            try:
                per = split(out, len(group)) if sig.batched else [out]
            except EngineError as e:  # an output without the batch dimension: the model's fault, this batch's
                log.error("%s: the model's outputs do not split into %d requests: %s", self.spec.name, len(group), e)
                self.fail(recs[idx], info[idx], Status.INTERNAL)
                continue
            self._answer_each(recs[idx], info[idx], per, model_ms)
        clock.lap("model")
        # (told before the answers go out, so a closed-loop client's next request always arrives after it)
        self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
        self.stats.mark_answered(model_total)
        clock.lap("respond")
        oldest = info[int(np.argmin(info["first_ns"]))]
        self._clock_ingest(int(oldest["first_ns"]), int(oldest["complete_ns"]))
        clock.end()
        if self.queue:
            clock.start()

    def _answer_each(self, recs: np.ndarray, info: np.ndarray, outputs: list[dict[str, np.ndarray]],
                     model_ms: float) -> None:
        """Answer each request OK with its own outputs as a multi-tensor body; requests whose bodies
        have the same length go out in one call."""
        bodies = []
        for i, o in enumerate(outputs):
            try:
                bodies.append(np.frombuffer(encode_arrays(o), np.uint8))
            except (TensorBodyError, ValueError) as e:  # an output the wire cannot carry: the model's fault
                log.error("%s: cannot encode the outputs of request %d: %s", self.spec.name,
                          int(info[i]["request_id"]), e)
                bodies.append(None)
        failed = [i for i, b in enumerate(bodies) if b is None]
        if failed:
            self.fail(recs[failed], info[failed], Status.INTERNAL)
        by_len: dict[int, list[int]] = {}
        for i, b in enumerate(bodies):
            if b is not None:
                by_len.setdefault(b.size, []).append(i)
        for rows in by_len.values():
            body = np.stack([bodies[i] for i in rows])
            self._answer(recs[rows], info[rows], body, compute_s=model_ms / 1e3, dtype=DType.TENSORS)

    def run_batch(self, msg: RunBatch) -> BatchDone:
        raise ValueError(f"{self.spec.name}: a model file is not served in dispatched mode")
