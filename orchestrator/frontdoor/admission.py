"""Admission at the HTTP and gRPC front door: admit an inference only if it is predicted to finish in time.

Why UDP holds its goodput under overload and the OIP doors did not: a UDP request costs the node
almost nothing until the instance looks at it (the native ingest places it), and the instance answers
DEADLINE_MISSED, without running it, a request its batch-latency model (`gpuprims.batching`) says
cannot make its deadline. An HTTP or gRPC request cost the front door its whole Python path (parse,
decode, place, wait, answer) before the node refused it, so under overload the door spent itself on
late requests. This module makes the same prediction at the door, before the tensor is decoded:

    ahead      = max(rows this door has in flight for the app, requests the app's instances hold)
    predicted  = ceil(ahead / (max_batch x instances)) x L(min(ahead, max_batch)) + L(rows)

where ``L`` is a `gpuprims.batching.LatencyModel` of the app's batch latency, learnt from the
instances' heartbeats (model time per batch and rows per batch between two heartbeats; a batch larger
than any measured counts as the largest measured, so only evidence refuses). A request of priority level ``k`` of
``N`` (1 highest) is admitted while ``predicted <= deadline x share(k)``, with ``share`` falling
linearly from 1 (level 1) to :data:`LOW_LEVEL_SHARE` (level N): lower levels are refused first and the
room left is the higher levels'. Before anything is learnt no prediction refuses (only the queue bound).

Triton's ``default_queue_policy`` (`orchestrator.frontdoor.policy`): ``max_queue_size`` refuses a
request while that many rows are ahead; ``default_timeout_microseconds`` / the request's ``timeout`` /
``allow_timeout_override`` give the deadline; ``timeout_action: DELAY`` admits a request predicted
late instead of refusing it (the node may still answer it DEADLINE_MISSED: its queue cannot move a
request to the back). A refusal is `Refused` (HTTP 503 or the app's 429 with ``Retry-After``, gRPC
UNAVAILABLE); a bad ``priority`` or ``timeout`` is `ParamError` (400 / INVALID_ARGUMENT). Both are
counted per app and level in its `AppStatistics` (status, Prometheus).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpuprims.batching import LatencyModel
from orchestrator.control.stats import AppStatistics, NodeLoad
from orchestrator.frontdoor.models import ModelInfo
from orchestrator.frontdoor.policy import PriorityError

T = TypeVar("T")

#: The lowest priority level is admitted only while its predicted completion takes at most this share
#: of its deadline; levels between get shares between this and 1 (level 1).
LOW_LEVEL_SHARE = 0.5
#: The instances' heartbeats are read at most this often per app (on the admission path).
NODE_POLL_S = 0.05
#: Batch latencies learnt longer ago than this are forgotten (a spell of slow batches stops counting).
MODEL_MEMORY_S = 60.0
#: Largest value a ``timeout`` parameter may take (µs; the wire's u32 deadline).
TIMEOUT_MAX_US = 2**32 - 1


class AdmissionError(Exception):
    """An inference the door answers before decoding it: ``kind`` is an `OipError` kind (its gRPC
    code), ``http_status`` its HTTP code, ``headers`` extra HTTP headers."""

    kind = "invalid"

    def __init__(self, message: str, *, http_status: int = 400, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.headers = dict(headers or {})


class ParamError(AdmissionError):
    """A request's ``priority`` or ``timeout`` parameter is not a valid value (400 / INVALID_ARGUMENT)."""


class Refused(AdmissionError):
    """Refused at admission (503 or 429 with ``Retry-After``, gRPC UNAVAILABLE)."""

    kind = "unavailable"

    def __init__(self, message: str, *, http_status: int, retry_after_s: int, level: int, reason: str) -> None:
        super().__init__(message, http_status=http_status, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s
        self.level = level
        self.reason = reason


@dataclass(frozen=True)
class RequestParams:
    """What admission reads of a request before its tensors: Triton's ``priority`` (0: the default
    level) and ``timeout`` (µs, 0: none) parameters, and its rows (the batch dimension of its first input)."""

    priority: int = 0
    timeout_us: int = 0
    rows: int = 1


@dataclass(frozen=True)
class Ticket:
    """An admitted inference: its level, its deadline (µs) and the prediction it was admitted on
    (None: nothing learnt yet)."""

    level: int
    deadline_us: int
    predicted_ms: float | None


@dataclass
class _App:
    model: LatencyModel = field(default_factory=LatencyModel)
    outstanding: int = 0  # rows this door has handed to the node and not had answered
    last: NodeLoad | None = None
    polled_s: float = -math.inf
    instances: int = 0  # instances seen running batches (0: not known yet)


def _int_param(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(f"parameter {name!r} must be an integer, got {value!r}")
    return value


def _checked(priority: int, timeout_us: int) -> tuple[int, int]:
    if priority < 0:
        raise ParamError(f"parameter 'priority' must be >= 0 (0: the default level), got {priority}")
    if not 0 <= timeout_us <= TIMEOUT_MAX_US:
        raise ParamError(f"parameter 'timeout' must be microseconds in 0..{TIMEOUT_MAX_US}, got {timeout_us}")
    return priority, timeout_us


def http_params(req: Mapping[str, Any]) -> RequestParams:
    """The admission parameters of an HTTP request's JSON header (its tensor data not looked at)."""
    params = req.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise ParamError(f"'parameters' must be an object, got {type(params).__name__}")
    priority, timeout_us = _checked(_int_param("priority", params.get("priority", 0)),
                                    _int_param("timeout", params.get("timeout", 0)))
    rows = 1
    inputs = req.get("inputs")
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], Mapping):
        shape = inputs[0].get("shape")
        if isinstance(shape, list) and shape and isinstance(shape[0], int) and not isinstance(shape[0], bool):
            rows = max(1, shape[0])
    return RequestParams(priority, timeout_us, rows)


def _grpc_int(params: Any, name: str) -> int:
    if name not in params:
        return 0
    p = params[name]
    which = p.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise ParamError(f"parameter {name!r} must be an integer (int64_param or uint64_param), got {which}")
    return int(getattr(p, which))


def grpc_params(req: Any, left_us: int | None = None) -> RequestParams:
    """The admission parameters of a parsed ``ModelInferRequest`` (its contents not looked at);
    ``left_us``, what is left of the call's own deadline, bounds the ``timeout``."""
    priority, timeout_us = _checked(_grpc_int(req.parameters, "priority"), _grpc_int(req.parameters, "timeout"))
    if left_us is not None and left_us > 0:
        timeout_us = left_us if timeout_us == 0 else min(timeout_us, left_us)
    rows = max(1, int(req.inputs[0].shape[0])) if req.inputs and req.inputs[0].shape else 1
    return RequestParams(priority, timeout_us, rows)


class Admission:
    """The front door's admission of every app it serves (one per `Core`; its loop's thread only).

    ``clock`` (monotonic seconds) is replaceable for tests; ``low_share``: :data:`LOW_LEVEL_SHARE`.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, low_share: float = LOW_LEVEL_SHARE,
                 poll_s: float = NODE_POLL_S) -> None:
        if not 0 < low_share <= 1:
            raise ValueError(f"low_share must be in (0, 1], got {low_share!r}")
        self.clock = clock
        self.low_share = low_share
        self.poll_s = poll_s
        self._apps: dict[str, _App] = {}

    def _app(self, info: ModelInfo) -> _App:
        st = self._apps.get(info.app_name)
        if st is None:
            st = self._apps[info.app_name] = _App()
        return st

    def seed(self, info: ModelInfo, latency_ms: Mapping[int, float]) -> None:
        """Prior batch latencies (ms by batch size) for ``info``'s app, e.g. from its profile."""
        self._app(info).model.seed(latency_ms)

    def observe(self, info: ModelInfo, batch_size: int, latency_ms: float) -> None:
        """A measured batch latency of ``info``'s app."""
        self._app(info).model.observe(batch_size, latency_ms, at_s=self.clock())

    def outstanding(self, info: ModelInfo) -> int:
        """Rows of ``info``'s app this door has in flight."""
        st = self._apps.get(info.app_name)
        return st.outstanding if st is not None else 0

    def share(self, level: int, levels: int) -> float:
        """The share of its deadline a request of ``level`` (of ``levels``) may be predicted to take."""
        if levels <= 1:
            return 1.0
        return 1.0 - (1.0 - self.low_share) * (level - 1) / (levels - 1)

    def _poll(self, st: _App, stats: AppStatistics | None) -> None:
        """Learn from the instances' heartbeats since the last poll (at most every ``poll_s``)."""
        now = self.clock()
        if stats is None or now - st.polled_s < self.poll_s:
            return
        st.polled_s = now
        load = stats.node_load()
        last, st.last = st.last, load
        if last is None:
            return
        batches = load.batches - last.batches
        rows = load.rows_run - last.rows_run
        busy = load.busy_ms - last.busy_ms
        if batches > 0 and rows > 0 and busy > 0:  # (an instance replaced makes these go back: skipped)
            st.model.observe(max(1, round(rows / batches)), busy / batches, at_s=now)
            st.instances = max(1, min(load.instances, batches))
        st.model.forget(now - MODEL_MEMORY_S)

    def predict_ms(self, info: ModelInfo, ahead: int, rows: int = 1) -> float | None:
        """Predicted time (ms) until a request of ``rows`` rows with ``ahead`` rows before it is answered;
        None before any batch latency is known."""
        st = self._app(info)
        if not st.model.known:
            return None
        # A batch larger than any measured is predicted as the largest measured one: refuse only on
        # evidence (the heartbeats measure the large batches an overload runs), never on a guess of
        # how batching scales.
        batch = max(1, info.max_batch)
        largest = max(st.model.points())
        per_round = batch * max(1, st.instances or info.instances or 1)
        own = math.ceil(rows / batch) * st.model.predict(min(rows, batch, largest))
        if ahead <= 0:
            return own
        return math.ceil(ahead / per_round) * st.model.predict(min(ahead, batch, largest)) + own

    def decide(self, info: ModelInfo, params: RequestParams, stats: AppStatistics | None = None) -> Ticket:
        """Admit an inference of ``info`` (a `Ticket`) or raise `Refused` / `ParamError`; counted in ``stats``."""
        policy = info.admission
        try:
            level = policy.level(params.priority)
        except PriorityError as e:
            raise ParamError(f"model {info.name!r}: {e}") from None
        deadline_us = policy.deadline_us(params.timeout_us, info.slo_ms)
        st = self._app(info)
        self._poll(st, stats)
        held = st.last.held if st.last is not None else 0
        ahead = max(st.outstanding, held)
        cap = policy.queue.max_queue_size
        if cap and ahead >= cap:
            self._refuse(info, stats, level, "queue_full", f"{ahead} requests queued, its max_queue_size is {cap}",
                         self.predict_ms(info, ahead, params.rows))
        predicted = self.predict_ms(info, ahead, params.rows)
        allowed_ms = deadline_us / 1e3 * self.share(level, policy.levels)
        if predicted is not None and predicted > allowed_ms and not policy.delay:
            self._refuse(info, stats, level, "predicted_late",
                         f"predicted to answer in {predicted:.1f} ms with {ahead} requests ahead, over the "
                         f"{allowed_ms:.1f} ms its deadline of {deadline_us / 1e3:g} ms leaves priority level {level}",
                         predicted)
        if stats is not None:
            stats.record_admission(level, None)
        return Ticket(level, deadline_us, predicted)

    def _refuse(self, info: ModelInfo, stats: AppStatistics | None, level: int, reason: str, why: str,
                predicted_ms: float | None) -> None:
        if stats is not None:
            stats.record_admission(level, reason)
            stats.record_inference(rows=0, duration_ns=0, ok=False, statuses={"REFUSED": 1})
        retry_s = max(1, math.ceil((predicted_ms or 0.0) / 1e3))
        raise Refused(f"model {info.name!r}: refused at admission: {why}; retry after {retry_s} s",
                      http_status=info.admission.refuse_status, retry_after_s=retry_s, level=level, reason=reason)

    @staticmethod
    def node_deadline_us(info: ModelInfo, deadline_us: int) -> int:
        """The deadline (µs, 0: the app's SLO) the node is asked to meet for a request that asked for
        ``deadline_us``: its own, unless the app's queue policy sets a default timeout (Triton's rule,
        `AdmissionPolicy.deadline_us`)."""
        if not info.admission.queue.default_timeout_us:
            return deadline_us
        return info.admission.deadline_us(deadline_us, info.slo_ms)

    async def track(self, info: ModelInfo, rows: int, work: Awaitable[T]) -> T:
        """Await ``work`` (``rows`` rows handed to the node) counted as in flight for ``info``'s app, until
        it ends in any way (answered, failed, cancelled by a client gone)."""
        st = self._app(info)
        st.outstanding += rows
        try:
            return await work
        finally:
            st.outstanding -= rows
