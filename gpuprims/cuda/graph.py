"""CUDA Graphs: capture work issued on streams once, replay it with one launch (cudaStreamBeginCapture,
cudaStreamEndCapture, cudaGraphInstantiate, cudaGraphLaunch, cudaGraphExecDestroy).

One class, two runtimes behind it, chosen as :func:`gpuprims.cuda.runtime.cuda` chooses:

* **A real GPU**: torch's proven capture, ``torch.cuda.CUDAGraph`` under ``torch.cuda.graph(g, pool=...,
  stream=...)``: capture on a side stream, torch's caching allocator gives the graph a private memory
  pool (shareable between the graphs of one engine, which never replay at once), and torch's kernels
  are what the graph holds.
* **The fake runtime** (``GPUPRIMS_FAKE_CUDA``): the fake's emulated stream capture. Work is issued as
  host launches (cudaLaunchHostFunc) on a fake stream; while it captures they are recorded as graph
  nodes, and a replay runs them on the replay stream's worker, in dependency order.

Both take the same calls from the code that captures, so an engine's capture code runs unchanged on
both::

    g = CudaGraph(device)
    with g.capture() as cap:          # cudaStreamBeginCapture on the capture stream ... EndCapture
        cap.launch(forward)           # forward() issues the model's work (host launch on the fake)
        # multi-stream (Opara): fork a stream from the capture stream, launch on it, join it back
        cap.fork(s1); cap.launch(branch, s1); cap.join(s1)
    g.replay(stream)                  # cudaGraphLaunch on the instance's stream
    g.close()                         # cudaGraphExecDestroy / cudaGraphDestroy

Errors of capture and launch are :class:`gpuprims.cuda.errors.CudaError` on both runtimes (torch's
text errors pass through :func:`gpuprims.cuda.errors.raise_from_message`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError, raise_from_message
from gpuprims.cuda.event import Event, Stream, StreamLike, stream_handle

#: cudaStreamCaptureMode by name (torch's ``capture_error_mode`` takes the same names).
CAPTURE_MODES: dict[str, int] = {"global": 0, "thread_local": 1, "relaxed": 2}

_count_lock = threading.Lock()
_captures = 0


def captures() -> int:
    """How many captures this process has begun (both runtimes): what tests count to prove that no
    capture happens on the serving path."""
    return _captures


def _counted() -> None:
    global _captures
    with _count_lock:
        _captures += 1


class Capture:
    """A capture in progress (given by :meth:`CudaGraph.capture`): issue work with :meth:`launch`, on
    the capture stream or on streams forked from it with :meth:`fork` and joined back with :meth:`join`.
    Every forked stream must be joined before the capture ends (else cudaErrorStreamCaptureUnjoined)."""

    def __init__(self, graph: CudaGraph, stream: Any) -> None:
        self.graph = graph
        #: The capture stream: a gpuprims Stream on the fake runtime, a torch.cuda.Stream on a GPU.
        self.stream = stream
        self.launches = 0
        self._events: list[Any] = []

    def _event(self) -> Any:
        if self.graph.fake:
            ev: Any = Event(self.graph.device)
        else:

            ev = torch.cuda.Event()
        self._events.append(ev)
        return ev

    def _handle_or_stream(self, stream: Any) -> Any:
        if self.graph.fake:
            return stream_handle(stream)
        return _torch_stream(stream, self.graph.device)

    def launch(self, fn: Callable[[], Any], stream: Any = None) -> None:
        """Issue ``fn``'s work on ``stream`` (default: the capture stream). On a GPU ``fn`` runs now,
        with ``stream`` current, and torch records its kernels; on the fake runtime ``fn`` is a host
        launch, recorded now and run at each replay (so it must not call CUDA itself)."""
        target = self.stream if stream is None else stream
        if self.graph.fake:
            runtime.cuda().launch_host_func(stream_handle(target), fn)
        else:

            with torch.cuda.stream(self._handle_or_stream(target)):
                fn()
        self.launches += 1

    def fork(self, stream: Any, after: Any = None) -> None:
        """Make ``stream`` part of the capture: it waits on an event recorded on ``after`` (default:
        the capture stream), which pulls it into the capture from that point (cudaEventRecord +
        cudaStreamWaitEvent)."""
        self._link(self.stream if after is None else after, stream)

    def join(self, stream: Any, into: Any = None) -> None:
        """Join ``stream``'s captured work back into ``into`` (default: the capture stream):
        ``into`` waits on an event recorded on ``stream``."""
        self._link(stream, self.stream if into is None else into)

    def wait(self, waiter: Any, on: Any) -> None:
        """A cross-stream edge inside the capture (a plan's event wait): ``waiter`` waits for the work
        issued on ``on`` so far."""
        self._link(on, waiter)

    def record(self, stream: Any) -> Any:
        """An event recorded now on ``stream`` (after the work issued there so far), for :meth:`wait_event`:
        what a plan records after an op that another stream waits for."""
        ev = self._event()
        ev.record(stream_handle(stream) if self.graph.fake else self._handle_or_stream(stream))
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait for ``event`` (cudaStreamWaitEvent); a stream not yet in the
        capture joins it from the event's point."""
        if self.graph.fake:
            runtime.cuda().cuda_stream_wait_event(stream_handle(stream), event.handle)
        else:
            self._handle_or_stream(stream).wait_event(event)

    def _link(self, src: Any, dst: Any) -> None:
        self.wait_event(dst, self.record(src))

    def _close(self) -> None:
        for ev in self._events:
            if self.graph.fake:
                ev.close()
        self._events.clear()


def capture_plan(cap: Capture, plan: Any, launch_op: Callable[[str], Any], streams: Sequence[Any]) -> None:
    """Issue a multi-stream plan inside a capture, following the contract of Opara's ``StreamPlan``
    (:mod:`gpuprims.opara.plan`): every stream but 0 forks from the capture stream; then each op of
    ``plan.order`` is launched on ``streams[plan.stream_of[op]]`` after waiting for the events recorded
    after the ops in ``plan.waits[op]``; an event is recorded after every op in ``plan.events``; at the
    end stream 0 waits for the ops in ``plan.join`` and for every other stream's last work, so the
    capture ends joined. ``streams[0]`` must be the capture stream; ``launch_op(op)`` issues one op's
    work (a host launch on the fake, kernels on a GPU). ``plan`` is duck-typed: anything with ``order``,
    ``stream_of``, ``waits``, ``num_streams`` and optionally ``events`` and ``join``."""
    if len(streams) < plan.num_streams:
        raise ValueError(f"the plan needs {plan.num_streams} streams, {len(streams)} given")
    same = (stream_handle(streams[0]) == stream_handle(cap.stream)) if cap.graph.fake else streams[0] is cap.stream
    if not same:
        raise ValueError("streams[0] must be the capture stream")
    for s in streams[1:plan.num_streams]:
        cap.fork(s)
    # An event after every op some other stream waits for (plan.events lists them; the waits are the
    # authority, so a plan without ``events`` works too).
    marks = set(getattr(plan, "events", ()) or ()) | {u for w in plan.waits.values() for u in w}
    marks |= set(getattr(plan, "join", ()) or ())
    events: dict[str, Any] = {}
    for op in plan.order:
        sid = plan.stream_of[op]
        for u in plan.waits.get(op, ()):
            if u not in events:
                raise ValueError(f"plan op {op!r} waits for {u!r}, which has no event before it (not in "
                                 "plan.events, or issued later)")
            cap.wait_event(streams[sid], events[u])
        cap.launch(functools.partial(launch_op, op), streams[sid])
        if op in marks:
            events[op] = cap.record(streams[sid])
    for u in getattr(plan, "join", ()) or ():
        if u in events:
            cap.wait_event(streams[0], events[u])
    for s in streams[1:plan.num_streams]:
        # Every forked stream ends joined: redundant where the plan's output op joined it already (an
        # extra edge to an ancestor), and what keeps EndCapture from cudaErrorStreamCaptureUnjoined if not.
        cap.join(s)


class CudaGraph:
    """One CUDA graph on ``device``: captured once with :meth:`capture`, replayed with :meth:`replay`,
    released with :meth:`close` (also by ``with``). ``pool``: on a GPU, a torch graph memory pool to
    share with other graphs that never replay at the same time (``torch.cuda.graph_pool_handle()`` or
    another graph's :meth:`pool`)."""

    def __init__(self, device: int = 0, *, mode: str = "global") -> None:
        if mode not in CAPTURE_MODES:
            raise ValueError(f"mode must be one of {sorted(CAPTURE_MODES)}, got {mode!r}")
        self.device = device
        self.mode = mode
        self.fake = runtime.is_fake()
        self.captured = False
        self.closed = False
        self.nodes = 0
        self._graph: int | None = None  # fake: cudaGraph_t
        self._exec: int | None = None  # fake: cudaGraphExec_t
        self._torch_graph: Any = None
        self._own_stream: Stream | None = None

    # -- capture -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, stream: StreamLike = None, *, pool: Any = None) -> Iterator[Capture]:
        """Capture the work issued inside the block (see :class:`Capture`), then instantiate it.

        ``stream``: the capture stream (never the legacy default stream); default a side stream of our
        own. On a GPU torch's ``torch.cuda.graph`` does the capture (with ``pool``). Raises CudaError
        if the capture breaks a rule of stream capture (an unjoined fork, a synchronize inside...); the
        capture is then ended and nothing is kept."""
        if self.closed:
            raise ValueError("graph is closed")
        if self.captured:
            raise ValueError("graph is already captured: make a new CudaGraph for another capture")
        _counted()
        if self.fake:
            with self._capture_fake(stream) as cap:
                yield cap
        else:
            with self._capture_torch(stream, pool) as cap:
                yield cap
        self.captured = True

    @contextlib.contextmanager
    def _capture_fake(self, stream: StreamLike) -> Iterator[Capture]:
        rt: Any = runtime.cuda()
        if stream is None:
            if self._own_stream is None:
                self._own_stream = Stream(self.device)
            stream = self._own_stream
        handle = stream_handle(stream)
        rt.cuda_stream_begin_capture(handle, CAPTURE_MODES[self.mode])
        cap = Capture(self, stream)
        try:
            try:
                yield cap
            except BaseException:
                with contextlib.suppress(CudaError):  # end the broken capture; its own error is secondary
                    g = rt.cuda_stream_end_capture(handle)
                    rt.cuda_graph_destroy(g)
                raise
            g = rt.cuda_stream_end_capture(handle)
            try:
                self._exec = int(rt.cuda_graph_instantiate(g))
            except BaseException:
                rt.cuda_graph_destroy(g)
                raise
            self._graph = int(g)
            self.nodes = len(rt.graph_nodes(g))
        finally:
            cap._close()

    @contextlib.contextmanager
    def _capture_torch(self, stream: StreamLike, pool: Any) -> Iterator[Capture]:
        side = _torch_stream(stream, self.device) if stream is not None else torch.cuda.Stream(self.device)
        g = torch.cuda.CUDAGraph()
        cap = Capture(self, side)
        try:
            with torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode=self.mode):
                yield cap
        except RuntimeError as e:
            raise_from_message(e, "torch.cuda.graph (cudaStreamBeginCapture .. cudaGraphInstantiate)")
        self._torch_graph = g

    # -- replay --------------------------------------------------------------------------------------
    def replay(self, stream: StreamLike = None) -> None:
        """Launch the graph on ``stream`` (cudaGraphLaunch; default: torch's current stream on a GPU,
        the legacy stream on the fake), after the work already queued there. Returns at once."""
        if self.closed:
            # What cudaGraphLaunch says of a destroyed executable graph.
            raise CudaError(1, "cudaErrorInvalidValue", "invalid argument", "cudaGraphLaunch (graph is closed)")
        if not self.captured:
            raise ValueError("graph has not been captured")
        if self.fake:
            runtime.cuda().cuda_graph_launch(self._exec, stream_handle(stream))
            return

        try:
            if stream is None:
                self._torch_graph.replay()
            else:
                with torch.cuda.stream(_torch_stream(stream, self.device)):
                    self._torch_graph.replay()
        except RuntimeError as e:
            raise_from_message(e, "cudaGraphLaunch")

    def pool(self) -> Any:
        """On a GPU, this graph's memory pool (to share with the next capture); None on the fake."""
        return None if self._torch_graph is None else self._torch_graph.pool()

    def close(self) -> None:
        """Destroy the executable graph and the graph (cudaGraphExecDestroy, cudaGraphDestroy), and the
        capture stream we made. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.fake:
            rt: Any = runtime.cuda()
            # A lost context (sticky fault) takes the graphs with it: logged by _release, not raised.
            if self._exec is not None:
                runtime._release(rt.cuda_graph_exec_destroy, self._exec)
                self._exec = None
            if self._graph is not None:
                runtime._release(rt.cuda_graph_destroy, self._graph)
                self._graph = None
        elif self._torch_graph is not None:
            self._torch_graph.reset()
            self._torch_graph = None
        if self._own_stream is not None:
            self._own_stream.close()
            self._own_stream = None

    def __enter__(self) -> CudaGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "captured" if self.captured else "empty"
        return f"CudaGraph(device={self.device}, {state}, {'fake' if self.fake else 'torch'})"


def _torch_stream(stream: Any, device: int) -> Any:
    """A torch stream for ``stream`` (a torch.cuda.Stream as it is; a gpuprims Stream or a raw handle as
    a torch.cuda.ExternalStream)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(stream_handle(stream), device=torch.device("cuda", device))
