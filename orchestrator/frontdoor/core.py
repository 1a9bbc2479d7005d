"""The protocol-independent half of the front door: models, one inference, errors, statistics.

An inference of ``[N, *input_shape]`` becomes N requests (one per row) handed together to the node
by a transport (orchestrator/frontdoor/transport.py: placed straight into the node's packet pool by
its ingest, or sent as wire datagrams to a UDP ingest), so they enter the same packet pool, queues,
batches, SLO accounting and metrics as any UDP client's requests. The N answers are stacked into
``[N, K]``. The first row that is not answered OK decides the error (:data:`STATUS_ERRORS`).
Each inference's time is split by stage (:data:`transport.STAGES`) per protocol: ``stages()``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from gpuprims.client import DEFAULT_TIMEOUT_S, AsyncClient, RequestLost, Result
from gpuprims.stats import StageClock
from gpuprims.tensorwire import TensorBodyError, decode, encode_arrays
from gpuprims.wire import DType, Status
from orchestrator.control.stats import AppStatistics
from orchestrator.frontdoor.admission import Admission, RequestParams, Ticket
from orchestrator.frontdoor.forward import Forwarder
from orchestrator.frontdoor.models import ModelInfo
from orchestrator.frontdoor.transport import STAGES, Marks, Transport, UdpTransport

#: Error kinds and the HTTP status code of each (the gRPC codes are in grpc_server.py).
HTTP_CODE = {"invalid": 400, "not_found": 404, "unavailable": 503, "deadline": 504, "internal": 500,
             "too_large": 413, "unauthenticated": 401}

#: Each wire status other than OK: the error kind it is answered with, and why.
STATUS_ERRORS: dict[Status, tuple[str, str]] = {
    Status.DEADLINE_MISSED: ("deadline", "could not be served within its deadline"),
    Status.OVERLOADED: ("unavailable", "node overloaded: refused at admission; retry later"),
    Status.INSTANCE_FAILED: ("unavailable", "the instance serving it failed; retry"),
    Status.BAD_REQUEST: ("invalid", "the node refused the input (size or dtype does not fit the app)"),
    Status.UNKNOWN_APP: ("unavailable", "no instance serves this model right now (starting or restarting)"),
    Status.INTERNAL: ("internal", "the model failed on this batch"),
    Status.SHUTTING_DOWN: ("unavailable", "the node is stopping"),
}

def _never_ready(_name: str) -> bool:
    return False


#: How often the front door's loop measures how far behind it runs (Core.watch_lag), while inferences
#: come: half the smallest shedding limit of its models, within these bounds; it stops ticking this long
#: after the last inference.
LAG_TICK_MIN_S = 0.005
LAG_TICK_MAX_S = 0.05
LAG_IDLE_AFTER_S = 1.0
#: The loop counts as behind only when this many ticks in a row were late: one stall (a GC pause, the
#: thread not scheduled on a busy machine) leaves nothing queued behind it, and shedding on it would
#: refuse a lone request that would have been served.
LAG_SUSTAINED_TICKS = 3
#: An inference is refused at once (unavailable: 503 / UNAVAILABLE) while the front door's loop runs
#: more than this fraction of the model's SLO behind (and at least SHED_MIN_LAG_MS): its request has
#: waited at least that long before being looked at, so it cannot be answered within its SLO, and
#: decoding and placing it would spend the loop's time on a late answer while everything behind it
#: waits longer still. At 1 no request that could still make its SLO is refused (at 0.5, tried first,
#: bench/peer's medium load lost a few percent of its attainment to spells of lag).
SHED_LAG_FRACTION = 1.0
SHED_MIN_LAG_MS = 10.0


class Unavailable(NamedTuple):
    """A model (or one version of it) the node cannot serve, and why."""

    name: str
    version: str
    reason: str


class OipError(Exception):
    """An error answered to the client: ``kind`` picks the HTTP and gRPC codes."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in HTTP_CODE:
            raise ValueError(f"unknown error kind {kind!r}")
        self.kind = kind
        super().__init__(message)

    @property
    def http_status(self) -> int:
        return HTTP_CODE[self.kind]


class Core:
    """Models by name and inference through a transport; shared by the HTTP and gRPC servers.

    ``client`` is the transport (an AsyncClient is wrapped in a UdpTransport). ``ready(name)`` says
    whether the node serves a model now (default: always); ``timeout_s`` is how long one row waits
    for its answer (default: the larger of 2 s and 3 x the app's SLO). ``statistics`` maps each model
    to its app's `AppStatistics`, where every inference is counted and the statistics extension reads
    (default: a record of the front door's own per model). ``forwarder`` (a fleet's routing table,
    orchestrator/frontdoor/forward.py) serves the models this node does not host by forwarding them to
    their owners; a model it hosts is never forwarded.
    """

    def __init__(self, infos: list[ModelInfo], client: Transport | AsyncClient, *, timeout_s: float | None = None,
                 ready: Callable[[str], bool] | None = None,
                 statistics: Mapping[str, AppStatistics] | None = None,
                 shed_lag_fraction: float | None = SHED_LAG_FRACTION, forwarder: Forwarder | None = None) -> None:
        #: Models by the app serving them: the model's name, or one version's app where the model's
        #: version_policy serves several versions at once (ModelInfo.app; ``model`` resolves OIP names).
        self.models = {m.app_name: m for m in infos}
        #: Models of the node's repository that cannot be served (listed by the index with the reason).
        self.unavailable: list[Unavailable] = []
        self.forwarder = forwarder
        self.transport: Transport = UdpTransport(client) if isinstance(client, AsyncClient) else client
        self.timeout_s = timeout_s
        self._ready = ready
        given = statistics or {}
        self.stats = {m.app_name: given.get(m.app_name) or AppStatistics() for m in infos}
        #: Stage durations of the last 1024 inferences answered OK, per protocol (http, grpc).
        self.clocks: dict[str, StageClock] = {}
        #: Overload shedding (:meth:`admit`): None turns it off.
        self.shed_lag_fraction = shed_lag_fraction
        self._late: collections.deque[float] = collections.deque(maxlen=LAG_SUSTAINED_TICKS)  # recent ticks' lateness
        self._tick_due: float | None = None  # loop.time() when its next tick is due (None: not watching)
        self._wake: asyncio.Event | None = None  # set by admit to wake an idle watch_lag
        self._last_admit = 0.0
        #: watch_lag stops ticking this long after the last inference (and starts at the next).
        self.lag_idle_after_s = LAG_IDLE_AFTER_S
        #: Inferences refused by admit, per model.
        self.shed: dict[str, int] = {}
        #: Admission from a prediction, queue policy and priority levels (orchestrator/frontdoor/admission.py).
        self.admission = Admission()

    def shed_limit_ms(self, info: ModelInfo) -> float:
        """How far behind the loop may run before inferences of ``info`` are shed (see :meth:`admit`)."""
        return max(SHED_MIN_LAG_MS, (self.shed_lag_fraction or 0.0) * info.slo_ms)

    def _tick_s(self) -> float:
        limits = [self.shed_limit_ms(m) for m in self.models.values()] or [SHED_MIN_LAG_MS]
        return min(LAG_TICK_MAX_S, max(LAG_TICK_MIN_S, min(limits) / 2e3))

    async def watch_lag(self, tick_s: float | None = None) -> None:
        """Run on the front door's loop until cancelled: measure how late a timer of ``tick_s`` fires
        (default: half the smallest shedding limit of the models, 5-50 ms), which is how long the loop
        takes to come round to a request waiting for it (see :meth:`lag_s`). It ticks only
        while inferences come (within ``lag_idle_after_s`` of the last): an idle node's loop is not woken."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._last_admit = loop.time()
        try:
            while True:
                if loop.time() - self._last_admit > self.lag_idle_after_s:
                    self._tick_due = None
                    self._late.clear()
                    self._wake.clear()
                    await self._wake.wait()
                tick = tick_s if tick_s is not None else self._tick_s()
                self._tick_due = loop.time() + tick
                await asyncio.sleep(tick)
                self._late.append(max(0.0, loop.time() - self._tick_due))
        finally:
            self._tick_due, self._wake = None, None
            self._late.clear()

    def lag_s(self) -> float:
        """How far behind the loop runs, sustained: the least lateness of the last
        :data:`LAG_SUSTAINED_TICKS` ticks (0 before there are that many, and when nothing watches)."""
        if len(self._late) < LAG_SUSTAINED_TICKS:
            return 0.0
        return min(self._late)

    def admit(self, info: ModelInfo, params: RequestParams | None = None) -> Ticket:
        """Refuse an inference of ``info`` (OipError unavailable, counted in ``shed`` and in the app's
        statistics as a ``SHED`` status) while the loop runs too far behind for its SLO (see
        :data:`SHED_LAG_FRACTION`), or (admission.Refused / ParamError) unless it is predicted to finish
        within its deadline at its priority level; called before the request is decoded."""
        if self.shed_lag_fraction is not None:
            self._shed(info)
        return self.admission.decide(info, params or RequestParams(), self.stats.get(info.app_name))

    def _shed(self, info: ModelInfo) -> None:
        if self._wake is not None:
            self._last_admit = asyncio.get_running_loop().time()
            if not self._wake.is_set():
                self._wake.set()
        lag_ms = self.lag_s() * 1e3
        limit_ms = self.shed_limit_ms(info)
        if lag_ms <= limit_ms:
            return
        self.shed[info.name] = self.shed.get(info.name, 0) + 1
        self.stats[info.app_name].record_inference(rows=0, duration_ns=0, ok=False, statuses={"SHED": 1})
        raise OipError("unavailable", f"model {info.name!r}: front door overloaded (its loop runs "
                                      f"{lag_ms:.0f} ms behind, over {limit_ms:.0f} ms for this model's "
                                      f"{info.slo_ms:g} ms SLO); retry later")

    def release(self) -> None:
        """Hold nothing of the node any more (the front door has stopped): a server that keeps its
        handlers past its stop (grpc does) must not keep the node, its pool or its ingest alive through
        ``ready``. Every model reads as not ready from now on."""
        self._ready = _never_ready

    def commit(self, protocol: str, marks: Marks) -> None:
        """Add one answered inference's stage durations to ``protocol``'s clock."""
        clock = self.clocks.get(protocol)
        if clock is None:
            clock = self.clocks[protocol] = StageClock(STAGES)
        clock.start()
        for stage, ns in marks.ns.items():
            clock.observe(stage, ns)
        clock.end()

    def stages(self) -> dict[str, Any]:
        """Per protocol: ``{"transport", "inferences", <stage>: {"p50_ms", "p99_ms", "mean_ms"}}``."""
        out: dict[str, Any] = {}
        for protocol, clock in self.clocks.items():
            snap = clock.snapshot()
            snap["inferences"] = snap.pop("batches")
            out[protocol] = {"transport": self.transport.name, **snap}
        return out

    def versions(self, name: str) -> list[ModelInfo]:
        """The versions of model ``name`` this node serves, ascending (one app each)."""
        info = self.models.get(name)
        if info is not None and info.name == name:
            return [info]
        return sorted((m for m in self.models.values() if m.name == name), key=lambda m: int(m.version))

    def model(self, name: str, version: str = "") -> ModelInfo:
        """Model ``name`` (OipError not_found): ``version`` of it, or without one its highest version that is
        ready (its highest when none is), as Triton routes an unversioned request."""
        served = self.versions(name)
        if len(served) > 1 or (served and version):
            pick = [m for m in served if m.version == version] if version else \
                [m for m in served if self._app_ready(m)] or served
            if not pick:
                raise OipError("not_found", f"model {name!r} has no version {version!r} (versions: "
                                            f"{', '.join(m.version for m in served)})")
            return pick[-1]
        info = served[0] if served else None
        if info is None and self.forwarder is not None:
            info = self.forwarder.info(name)
            if info is not None:
                self.stats.setdefault(name, AppStatistics())
        if info is None:
            where = " (nor in the fleet's routing table)" if self.forwarder is not None else ""
            raise OipError("not_found", f"unknown model {name!r}{where}; models: {', '.join(sorted(self.models))}")
        if version not in ("", info.version):
            raise OipError("not_found", f"model {name!r} has no version {version!r} (only {info.version!r})")
        return info

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index: every model served (READY, or UNAVAILABLE while no instance serves it)
        and every model of the node's model repository that cannot be served, with the reason."""
        out = [{"name": m.name, "version": m.version, "state": "READY" if self._app_ready(m) else "UNAVAILABLE"}
               for m in sorted(self.models.values(), key=lambda m: (m.name, int(m.version)))]
        out += [{"name": u.name, "version": u.version, "state": "UNAVAILABLE", "reason": u.reason}
                for u in self.unavailable]
        return [m for m in out if m["state"] == "READY" or not ready_only]

    def model_ready(self, name: str, version: str = "") -> bool:
        info = self.model(name, version)
        if self.models.get(info.app_name) is not info:  # forwarded: ready while the table routes it somewhere
            return self.forwarder is not None and self.forwarder.route(name) is not None
        return self._app_ready(info)

    def _app_ready(self, info: ModelInfo) -> bool:
        return self._ready is None or bool(self._ready(info.app_name))

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """Triton's ModelStatistics of model ``name`` (``version`` of it, or every version), or of every
        model this node serves."""
        infos = ([self.model(name, version)] if version else self.versions(name) or [self.model(name)]) if name \
            else sorted(self.models.values(), key=lambda m: (m.name, int(m.version)))
        out = []
        for m in infos:
            st = self.stats.setdefault(m.app_name, AppStatistics())
            out.append({**st.model_statistics(m.name), "version": m.version})
        return out

    def forwarded(self, info: ModelInfo) -> bool:
        """Whether inferences of ``info`` go to another node (it is not hosted here)."""
        return self.forwarder is not None and self.models.get(info.app_name) is not info

    def server_ready(self) -> bool:
        return all(self._app_ready(m) for m in self.models.values())

    def row_timeout_s(self, info: ModelInfo, deadline_us: int = 0) -> float:
        """How long to wait for one row's answer: the node answers by about its deadline (the request's
        own, else the app's SLO) plus a batch, so three deadlines, and never less than the default."""
        if self.timeout_s is not None:
            return self.timeout_s
        deadline_s = deadline_us / 1e6 if deadline_us > 0 else info.slo_ms / 1e3
        return max(DEFAULT_TIMEOUT_S, 3 * deadline_s)

    def check_input(self, info: ModelInfo, name: str, datatype: str, shape: list[int]) -> None:
        """Refuse (OipError invalid) an input that is not this model's, before reading its data."""
        if name != "input":
            raise OipError("invalid", f"model {info.name!r} has one input named 'input', got {name!r}")
        if datatype != info.datatype:
            raise OipError("invalid", f"input 'input' of model {info.name!r} is {info.datatype}, got {datatype}")
        if len(shape) != len(info.input_shape) + 1 or tuple(shape[1:]) != info.input_shape:
            raise OipError("invalid", f"input 'input' of model {info.name!r} has shape "
                                      f"[-1, {', '.join(map(str, info.input_shape))}], got {list(shape)}")
        if not 1 <= shape[0] <= info.max_batch:  # as Triton: a batch is at most the model's max_batch_size
            raise OipError("invalid", f"batch of {shape[0]} rows; model {info.name!r} takes 1..{info.max_batch} "
                                      "rows per inference (its max_batch)")

    async def infer(self, info: ModelInfo, x: np.ndarray, *, deadline_us: int = 0,
                    marks: Marks | None = None) -> np.ndarray:
        """Run ``x`` ([N, *input_shape]) through the node; [N, K] float32, or OipError.

        ``marks`` (the request's stage durations so far) gets the submit, node, back and collect stages.
        """
        t0 = time.monotonic_ns()
        st = self.stats[info.app_name]
        marks = marks if marks is not None else Marks(t0)
        statuses: dict[str, int] = {}
        try:
            deadline_us = self.admission.node_deadline_us(info, deadline_us)
            timeout_s = self.row_timeout_s(info, deadline_us)
            if self.forwarded(info):
                assert self.forwarder is not None
                results = await self.forwarder.rows(info, x, deadline_us=deadline_us, timeout_s=timeout_s, marks=marks)
            else:
                results = await self.admission.track(info, len(x), self.transport.rows(
                    info.app_id, x, deadline_us=deadline_us, timeout_s=timeout_s, marks=marks))
            t_node = time.monotonic_ns()
            out = self._collect(info, results, statuses)
        except OipError:
            st.record_inference(rows=len(x), duration_ns=time.monotonic_ns() - t0, ok=False, statuses=statuses)
            raise
        st.record_inference(rows=len(x), duration_ns=time.monotonic_ns() - t0, ok=True, statuses=statuses,
                            node_ns=t_node - t0)
        marks.lap("collect")
        return out

    def _rows(self, info: ModelInfo, x: np.ndarray, *, deadline_us: int, timeout_s: float, marks: Marks,
              dtype: DType | None = None) -> Awaitable[list[Result | BaseException]]:
        """Send ``x``'s rows to the node, or to the model's owner when it is forwarded (a fleet's)."""
        if self.forwarded(info):
            assert self.forwarder is not None
            return self.forwarder.rows(info, x, deadline_us=deadline_us, timeout_s=timeout_s, marks=marks, dtype=dtype)
        return self.transport.rows(info.app_id, x, deadline_us=deadline_us, timeout_s=timeout_s, marks=marks,
                                   dtype=dtype)

    async def infer_tensors(self, info: ModelInfo, requests: list[dict[str, np.ndarray]], *, deadline_us: int = 0,
                            marks: Marks | None = None) -> list[dict[str, np.ndarray]]:
        """Run a model file's requests (each a dict of named tensors, already checked against its
        signature) through the node as multi-tensor bodies; each request's outputs, or OipError."""
        t0 = time.monotonic_ns()
        st = self.stats[info.app_name]
        marks = marks if marks is not None else Marks(t0)
        statuses: dict[str, int] = {}
        try:
            bodies = [np.frombuffer(encode_arrays(r), np.uint8) for r in requests]
            if len({b.size for b in bodies}) == 1:
                groups = [list(range(len(bodies)))]
            else:  # rows of one batched inference with dynamic dimensions of their own sizes
                groups = [[i] for i in range(len(bodies))]
            deadline_us = self.admission.node_deadline_us(info, deadline_us)
            timeout_s = self.row_timeout_s(info, deadline_us)
            results: list[Result | BaseException] = [RequestLost(info.app_id, 0, timeout_s, 1)] * len(bodies)
            got = await self.admission.track(info, len(bodies), asyncio.gather(*[
                self._rows(info, np.stack([bodies[i] for i in g]), deadline_us=deadline_us,
                           timeout_s=timeout_s, marks=marks, dtype=DType.TENSORS) for g in groups]))
            for g, rs in zip(groups, got):
                for i, r in zip(g, rs):
                    results[i] = r
            t_node = time.monotonic_ns()
            out = [self._tensors(info, r) for r in self._collect_results(info, results, statuses)]
        except OipError:
            st.record_inference(rows=len(requests), duration_ns=time.monotonic_ns() - t0, ok=False,
                                statuses=statuses)
            raise
        st.record_inference(rows=len(requests), duration_ns=time.monotonic_ns() - t0, ok=True, statuses=statuses,
                            node_ns=t_node - t0)
        marks.lap("collect")
        return out

    @staticmethod
    def _tensors(info: ModelInfo, output: np.ndarray) -> dict[str, np.ndarray]:
        try:
            return {t.name: t.array for t in decode(output)}
        except TensorBodyError as e:
            raise OipError("internal", f"model {info.name!r}: the node's answer does not decode: {e}") from None

    def _collect_results(self, info: ModelInfo, results: list[Result | BaseException],
                         statuses: dict[str, int]) -> list[np.ndarray]:
        """Each row's OK answer body, in order; the first row that is not OK decides the error."""
        first: OipError | None = None
        rows = []
        for r in results:
            if isinstance(r, RequestLost):
                statuses["LOST"] = statuses.get("LOST", 0) + 1
                first = first or OipError("deadline", f"model {info.name!r}: no answer from the node within "
                                                      f"{r.timeout_s:g} s")
                continue
            if isinstance(r, BaseException):
                raise r
            statuses[r.status.name] = statuses.get(r.status.name, 0) + 1
            if not r.ok:
                kind, why = STATUS_ERRORS.get(r.status, ("internal", "unexpected status"))
                first = first or OipError(kind, f"model {info.name!r}: {r.status.name}: {why}")
                continue
            assert r.output is not None
            rows.append(r.output)
        if first is not None:
            raise first
        return rows

    def _collect(self, info: ModelInfo, results: list[Result | BaseException],
                 statuses: dict[str, int]) -> np.ndarray:
        rows = [r.astype(np.float32, copy=False) for r in self._collect_results(info, results, statuses)]
        if len({len(r) for r in rows}) > 1:
            raise OipError("invalid", f"model {info.name!r}: rows ended at stages with different output sizes "
                                      f"({sorted({len(r) for r in rows})}); send one row per inference")
        return np.stack(rows)
