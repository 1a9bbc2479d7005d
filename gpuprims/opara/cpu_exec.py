"""Run a ``StreamPlan`` on CPU threads: one thread per stream, ``threading.Event`` as the CUDA events.

``StreamExecutor(graph, plan)`` is the plan's reference run: stream ``s`` is a thread that runs
``plan.stream_ops(s)`` in order; before an op it waits for the events of ``plan.waits[op]`` (set when
those ops finish), and at the end stream 0 waits for ``plan.join``. The inputs are in place before
any stream starts (the fork). Every operator computes exactly what eager computes on the same
tensors, so the output is bit-identical to running the model directly (the tests check it with
``torch.equal``) as long as each operator's kernel does not depend on the thread count it runs with.

Threads and cores. Each stream thread sets its own torch intra-op thread count (OpenMP's count is
per calling thread): ``intra_op_threads``, by default the caller's count, i.e. what eager runs each
operator with. That default is what makes the output bit-identical: oneDNN picks a convolution's
blocking by the thread count, so the same convolution at batch 8 differs in the last bits between 1
and 2 threads (measured on GoogLeNet: 4e-6). ``intra_op_threads=1`` keeps every stream to one core
(no team per stream, no oversubscription when there are more streams than cores) and is equal to
eager only within float rounding. ``torch.set_num_threads`` in a worker also changes the default that
threads created later start with; ``close()`` puts the caller's count back.

Errors and time. An op that raises ends the run: the other streams stop at their next wait, and the
call raises ``OperatorError`` naming the op, what it is and its stream, chained to the original
exception. Every wait is bounded by ``timeout_s``; a run that does not finish in time raises
``ExecutorTimeout`` naming what was waited for, and the executor refuses further runs (a thread may
still be inside an operator). ``close()`` (or ``with``) stops the threads; runs are serialised.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import map_arg

from gpuprims.opara.graph import INPUT, OUTPUT, OpGraph
from gpuprims.opara.plan import StreamPlan


class OperatorError(RuntimeError):
    """An operator raised while a plan ran; ``node``, ``what`` and ``stream`` say which."""

    def __init__(self, node: str, what: str, stream: int, cause: str) -> None:
        super().__init__(f"op {node!r} ({what}) on stream {stream} raised {cause}")
        self.node, self.what, self.stream = node, what, stream

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.node, self.what, self.stream, str(self).split(" raised ", 1)[-1]))


class ExecutorTimeout(TimeoutError):
    """A run did not finish within the executor's ``timeout_s``."""


class _Abort(Exception):
    """Another stream failed: this one stops."""


class _Run:
    """State of one run shared by the stream threads."""

    def __init__(self, env: dict[str, Any], events: tuple[str, ...], streams: int, deadline: float) -> None:
        self.env = env
        self.done = {n: threading.Event() for n in events}
        self.failed = threading.Event()
        self.error: tuple[str, int, BaseException] | None = None
        self.timeout: str | None = None
        self.deadline = deadline
        self._lock = threading.Lock()
        self._left = streams
        self.finished = threading.Event()

    def fail(self, node: str, stream: int, exc: BaseException) -> None:
        with self._lock:
            if self.error is None and self.timeout is None:
                self.error = (node, stream, exc)
        self.abort()

    def time_out(self, message: str) -> None:
        with self._lock:
            if self.error is None and self.timeout is None:
                self.timeout = message
        self.abort()

    def abort(self) -> None:
        self.failed.set()
        for ev in self.done.values():
            ev.set()  # wake every waiter; each sees ``failed`` and stops

    def wait_for(self, producer: str, consumer: str, stream: int) -> None:
        remaining = self.deadline - time.monotonic()
        if not self.done[producer].wait(timeout=max(0.0, remaining)):
            self.time_out(f"op {consumer!r} on stream {stream} waited longer than the run's deadline for "
                          f"{producer!r}")
            raise _Abort
        if self.failed.is_set():
            raise _Abort

    def stream_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.finished.set()


_Step = tuple[str, tuple[str, ...], Callable[[dict[str, Any]], Any], bool]


def _stop(queues: list[queue.SimpleQueue[_Run | None]], threads: list[threading.Thread], timeout_s: float) -> None:
    for q in queues:
        q.put(None)
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()))


class StreamExecutor:
    """Runs ``plan`` of ``graph`` (from ``op_graph``) on one thread per stream (module docstring)."""

    def __init__(self, graph: OpGraph, plan: StreamPlan, *, intra_op_threads: int | None = None,
                 timeout_s: float = 60.0) -> None:
        if graph.module is None:
            raise ValueError("graph has no traced module: build it with gpuprims.opara.op_graph(model, input)")
        if sorted(plan.order) != sorted(graph.names):
            missing = sorted(set(graph.names) - set(plan.order))
            extra = sorted(set(plan.order) - set(graph.names))
            raise ValueError(f"plan does not match the graph: missing {missing[:5]}, unknown {extra[:5]}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        self._caller_threads = torch.get_num_threads()
        if intra_op_threads is None:
            intra_op_threads = self._caller_threads
        if isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int) or intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be an integer >= 1, got {intra_op_threads!r}")
        self.graph, self.plan = graph, plan
        self.intra_op_threads = intra_op_threads
        self.timeout_s = float(timeout_s)
        gm = graph.module
        nodes = {n.name: n for n in gm.graph.nodes}
        self._inputs = [n for n in plan.order if graph.op(n).kind == INPUT]
        self._output = next((n for n in plan.order if graph.op(n).kind == OUTPUT), None)
        self._events = plan.events
        event_set = set(plan.events)
        self._programs: list[list[_Step]] = [[] for _ in range(plan.num_streams)]
        for name in plan.order:
            if graph.op(name).kind == INPUT:
                continue
            fn = _compile(gm, nodes[name])
            self._programs[plan.stream_of[name]].append((name, plan.waits[name], fn, name in event_set))
        self._queues: list[queue.SimpleQueue[_Run | None]] = [queue.SimpleQueue() for _ in self._programs]
        self._threads = [
            threading.Thread(target=self._worker, args=(s,), name=f"opara-stream-{s}", daemon=True)
            for s in range(plan.num_streams)
        ]
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop, self._queues, self._threads, 5.0)

    def __call__(self, *inputs: Any) -> Any:
        """Run the plan on ``inputs`` (the model's positional inputs); returns the model's output."""
        if len(inputs) != len(self._inputs):
            raise ValueError(f"model takes {len(self._inputs)} inputs, got {len(inputs)}")
        with self._lock:
            if self._closed:
                raise RuntimeError("StreamExecutor is closed")
            if self._broken is not None:
                raise RuntimeError(f"StreamExecutor is unusable after an earlier timeout: {self._broken}")
            run = _Run(dict(zip(self._inputs, inputs)), self._events, len(self._programs),
                       time.monotonic() + self.timeout_s)
            for q in self._queues:
                q.put(run)
            # The streams bound their own waits by the deadline; this bounds an operator that never returns.
            if not run.finished.wait(timeout=self.timeout_s + 1.0):
                run.time_out("a stream did not finish its operators within the run's deadline")
                self._broken = run.timeout
            if run.error is not None:
                node, stream, exc = run.error
                raise OperatorError(node, self.graph.op(node).what, stream,
                                    f"{type(exc).__name__}: {exc}") from exc
            if run.timeout is not None:
                self._broken = self._broken or run.timeout
                raise ExecutorTimeout(f"run timed out after timeout_s={self.timeout_s}: {run.timeout}")
            return run.env[self._output] if self._output is not None else None

    def _worker(self, stream: int) -> None:
        # get_num_threads first: a thread's first parallel op otherwise initialises its OpenMP count
        # from torch's process-wide default, which another executor's workers may have just changed.
        torch.get_num_threads()
        torch.set_num_threads(self.intra_op_threads)
        program = self._programs[stream]
        join = self.plan.join if stream == 0 else ()
        q = self._queues[stream]
        while True:
            run = q.get()
            if run is None:
                return
            name = ""
            try:
                with torch.inference_mode():
                    for name, waits, fn, record in program:
                        for u in waits:
                            run.wait_for(u, name, stream)
                        run.env[name] = fn(run.env)
                        if record:
                            run.done[name].set()
                    for u in join:
                        run.wait_for(u, "<join>", stream)
            except _Abort:
                pass
            except BaseException as exc:  # any operator failure ends the run and reaches the caller
                run.fail(name, stream, exc)
            finally:
                run.stream_done()

    def close(self) -> None:
        """Stop the stream threads and put back the caller's torch thread count (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        torch.set_num_threads(self._caller_threads)

    def __enter__(self) -> StreamExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compile(gm: Any, node: Any) -> Callable[[dict[str, Any]], Any]:
    """A function of the environment that evaluates one fx node."""
    args, kwargs = node.args, node.kwargs

    def load(env: dict[str, Any]) -> tuple[Any, Any]:
        return map_arg(args, lambda a: env[a.name]), map_arg(kwargs, lambda a: env[a.name])

    if node.op == "call_module":
        mod = gm.get_submodule(node.target)

        def call_module(env: dict[str, Any]) -> Any:
            a, k = load(env)
            return mod(*a, **k)

        return call_module
    if node.op == "call_function":
        target = node.target

        def call_function(env: dict[str, Any]) -> Any:
            a, k = load(env)
            return target(*a, **k)

        return call_function
    if node.op == "call_method":
        method = node.target

        def call_method(env: dict[str, Any]) -> Any:
            a, k = load(env)
            return getattr(a[0], method)(*a[1:], **k)

        return call_method
    if node.op == "get_attr":
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return lambda env: value
    if node.op == "output":
        def output(env: dict[str, Any]) -> Any:
            return map_arg(args[0], lambda a: env[a.name])

        return output
    raise ValueError(f"unexpected fx node {node.name!r} of kind {node.op!r}")
