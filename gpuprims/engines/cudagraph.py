"""``engine: cudagraph``: the model captured into CUDA graphs, one per batch bucket, replayed on the
instance's stream (cuda backend only).

At :meth:`~CudaGraphEngine.prepare` (never on the serving path):

1. a static input buffer ``(max_batch, C, H, W)`` float32 is allocated in device memory; it *is*
   :meth:`~CudaGraphEngine.static_input`, so GPU-DMA gathers a batch straight into it and a request goes
   pool -> kernel -> graph with no copy;
2. the model runs ``warmup`` times per bucket on a side stream (cuDNN picks its algorithms, lazy
   initialisation happens, the caching allocator fills), outside any capture, as torch's CUDA graph
   notes require;
3. one graph is captured per bucket (the powers of two up to ``max_batch``, and ``max_batch``), each
   reading ``static[:bucket]``, largest first, all sharing one graph memory pool (they never replay at
   once).

:meth:`~CudaGraphEngine.run` takes ``n`` rows: if they are not already the static buffer's first rows
it copies them in (on the stream), picks the smallest bucket >= n, replays its graph on the instance's
stream (``Target.stream``) and returns the first ``n`` rows of that graph's output. It returns at once:
the output is complete when an event recorded on the stream after ``run()`` completes, which is what
Sync-lite waits for (the instance's run seam), or :meth:`~CudaGraphEngine.synchronize`. The output is
valid until the next ``run()``. Rows ``n..bucket`` of the static buffer hold older batches' data: in
eval mode no row of a batch affects another, so the first ``n`` output rows do not depend on them.

On the fake CUDA runtime the same code runs through the fake's stream capture: the model's forward is
issued as a host launch on the capture stream, recorded into the graph, and run at each replay on the
instance's fake stream (writing into a static output buffer).

``streams: single`` (default) captures the model's forward on one stream. ``streams: opara`` captures
Opara's operator-parallel graph (docs/opara.md): per bucket, after the warm-up, the model is traced into
its operator graph at that batch size (:func:`gpuprims.opara.op_graph`, which runs it once more) and
planned (:func:`gpuprims.opara.plan_streams`: Algorithm 2's launch order, Algorithm 1's streams, capped
at the option ``max_streams``, the minimal event waits); the capture then follows the plan
(:func:`gpuprims.cuda.graph.capture_plan`): every side stream forks from the capture stream, each
operator is launched on its stream after waiting for the events its plan lists, and every side stream
joins back before the capture ends. The result is still one graph per bucket, replayed on the
instance's stream exactly like ``single``: the streams exist only inside the graph. Every operator's
intermediate tensors are held until the capture ends, so torch's allocator never hands memory one
stream still reads to another stream during the capture. On the fake runtime each operator is one
host launch on its stream, so the fake's capture checks the fork, the waits and the join, and a
replay runs the operators in the graph's dependency order. ``describe()`` reports the plan per bucket
(streams, events, waits, planning time).

A captured graph holds this process's device addresses, so it is not cached on disk: ``prepare``
captures each time (in the shadow's pre-warm, off the serving path); ``describe()`` says so.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from typing import Any, ClassVar

import torch

from gpuprims.backend import torch_device
from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError
from gpuprims.cuda.event import Event, Stream, stream_handle
from gpuprims.cuda.graph import CudaGraph, _torch_stream, capture_plan
from gpuprims.engines.base import Engine, EngineError, Progress, check_batch
from gpuprims.engines.kinds import ENGINE_KINDS
from gpuprims.opara import op_graph, plan_streams
from gpuprims.opara.cpu_exec import _compile
from gpuprims.opara.graph import INPUT, OUTPUT

log = logging.getLogger("gpuprims.engines")


def buckets_for(max_batch: int) -> list[int]:
    """The batch buckets of ``max_batch``: every power of two below it, and itself."""
    out = [1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch]
    return [*out, max_batch]


def device_tensor(shape: tuple[int, ...], device: int) -> tuple[runtime.DeviceMemory, Any]:
    """Zeroed float32 device memory of ``shape`` (cudaMalloc, ours, tracked by the runtime) and a torch
    tensor viewing it: a CUDA tensor on a GPU, a CPU tensor over the fake's device memory (host memory)."""
    nbytes = math.prod(shape) * 4
    mem = runtime.DeviceMemory(nbytes, device)
    if runtime.is_fake():
        flat = torch.frombuffer((ctypes.c_char * nbytes).from_address(mem.ptr), dtype=torch.uint8)
    else:
        flat = torch.as_tensor(mem, device=torch.device("cuda", device))
    t = flat.view(torch.float32).view(*shape)
    t.zero_()
    return mem, t


def bucket_of(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``n`` rows."""
    for b in buckets:
        if b >= n:
            return b
    raise EngineError(f"a batch of {n} rows exceeds the largest bucket {buckets[-1]}")


class CudaGraphEngine(Engine):
    """CUDA graphs per batch bucket, replayed on the instance's stream (see the module docstring)."""

    kind = "cudagraph"
    spec = ENGINE_KINDS["cudagraph"]
    #: A padded bucket may run other kernels (cuDNN picks per batch size) than eager at ``n`` rows.
    tolerance = (1e-4, 1e-5)
    uses_torch_weights = True
    #: run() enqueues on Target.stream and returns at once; completion is an event recorded after it.
    asynchronous: ClassVar[bool] = True

    # -- prepare -------------------------------------------------------------------------------------
    def _prepare(self, module: Any, progress: Progress | None) -> None:
        t0 = time.perf_counter()
        self.fake = runtime.is_fake()
        dev = self.target.device_index
        tdev = torch_device("cuda", dev)
        if module is None:
            module = self.source.build_module(tdev)
        self.module = module
        self.buckets = buckets_for(self.source.max_batch)
        self.graphs: dict[int, CudaGraph] = {}
        self._outs: dict[int, Any] = {}
        self._own_stream: Stream | None = None
        self._event: Event | None = None
        self._keep: Any = None
        self.captures = 0
        self.plans: dict[int, Any] = {}  # streams: opara: the StreamPlan of each bucket
        self._envs: dict[int, dict[str, Any]] = {}  # fake + opara: each bucket's operator values
        self._side: list[Any] = []  # streams: opara: the side streams the captures fork
        self.replays = 0
        self._mem, self._static = device_tensor((self.source.max_batch, *self.source.input_shape), dev)
        try:
            self._warm_up(progress)
            self._capture_all(progress)
        except BaseException:
            self.close()
            raise
        self.info.build_ms = (time.perf_counter() - t0) * 1e3
        self.info.extra.update({"buckets": list(self.buckets), "captures": self.captures,
                                "streams": self.options["streams"], "runtime": "fake" if self.fake else "torch",
                                **self._plan_summary(),
                                "graph_nodes": {b: g.nodes for b, g in self.graphs.items()} if self.fake else None,
                                "cached": "no: a CUDA graph holds this process's device addresses"})

    def _say(self, progress: Progress | None, msg: str, frac: float | None) -> None:
        if progress is not None:
            progress(msg, frac)

    def _warm_up(self, progress: Progress | None) -> None:
        """``warmup`` eager runs per bucket, outside any capture (on a side stream on a GPU, as torch's
        CUDA graph notes ask), so lazy initialisation never happens inside a capture."""
        n = self.options["warmup"]
        self._say(progress, f"cudagraph: warming up {len(self.buckets)} bucket(s) x {n}", 0.0)
        if self.fake:
            with torch.no_grad():
                for b in self.buckets:
                    for _ in range(n):
                        y = self.module(self._static[:b])
            self._out = torch.empty((self.source.max_batch, *y.shape[1:]), dtype=y.dtype)
            return
        dev = self.target.device_index
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.no_grad():
            for b in self.buckets:
                for _ in range(n):
                    self.module(self._static[:b])
        torch.cuda.current_stream(dev).wait_stream(side)
        side.synchronize()

    def _capture_all(self, progress: Progress | None) -> None:
        pool = None if self.fake else torch.cuda.graph_pool_handle()
        order = sorted(self.buckets, reverse=True)  # largest first: the shared pool is sized once
        for i, b in enumerate(order):
            self._say(progress, f"cudagraph: capturing bucket {b} ({i + 1}/{len(order)})", i / len(order))
            # thread_local: only this thread's unsafe calls break the capture, so an instance's other
            # threads (ingest, control, a serving loop while a shadow pre-warms) may use CUDA meanwhile.
            g = CudaGraph(self.target.device_index, mode="thread_local")
            self.graphs[b] = g  # closed by close() even if the capture fails
            if self.options["streams"] == "opara":
                self._capture_opara(g, b, pool)
            else:
                with g.capture(pool=pool) as cap:
                    cap.launch(self._forward(b))
            self.captures += 1
        self._say(progress, f"cudagraph: {len(order)} graph(s) captured", 1.0)

    def _capture_opara(self, g: CudaGraph, b: int, pool: Any) -> None:
        """Plan bucket ``b`` with Opara and capture the plan into ``g`` (module docstring)."""
        static = self._static[:b]
        try:
            graph = op_graph(self.module, static)
        except ValueError as e:
            raise EngineError(f"engine 'cudagraph' streams: opara cannot plan {self.source.model!r}: {e}") from e
        plan = plan_streams(graph, max_streams=self.options["max_streams"])
        self.plans[b] = plan
        while len(self._side) < plan.num_streams - 1:
            self._side.append(Stream(self.target.device_index) if self.fake
                              else torch.cuda.Stream(self.target.device_index))
        gm = graph.module
        nodes = {n.name: n for n in gm.graph.nodes}
        fns: dict[str, Any] = {}
        output = ""
        env: dict[str, Any] = {}
        for name in plan.order:
            kind = graph.op(name).kind
            if kind == INPUT:
                env[name] = static  # the model's one input: the static buffer's first b rows
            else:
                fns[name] = _compile(gm, nodes[name])
            if kind == OUTPUT:
                output = name
        out = self._out if self.fake else None

        def launch_op(name: str) -> None:
            fn = fns.get(name)
            if fn is None:  # the input: in place before the graph runs
                return
            # no_grad here, not around the capture: on the fake this runs on a stream's worker thread at
            # each replay, and grad mode is per thread.
            with torch.no_grad():
                value = fn(env)
                env[name] = value
                if name == output and out is not None:
                    out[:b].copy_(value)

        with g.capture(pool=pool) as cap:
            capture_plan(cap, plan, launch_op, [cap.stream, *self._side[:plan.num_streams - 1]])
        if self.fake:
            self._envs[b] = env  # the replays run launch_op again, on this env
        else:
            # The graph's pool keeps its memory; only the output tensor, which replays rewrite, is kept.
            self._outs[b] = env[output]
            env.clear()

    def _plan_summary(self) -> dict[str, Any]:
        """What describe() shows of the Opara plans (nothing for streams: single)."""
        if not self.plans:
            return {}
        per = {b: p.describe() for b, p in sorted(self.plans.items())}
        return {"opara": {"max_streams": self.options["max_streams"],
                          "num_streams": max(p.num_streams for p in self.plans.values()),
                          "num_events": max(p.num_events for p in self.plans.values()),
                          "planning_ms": round(sum(p.planning_ms for p in self.plans.values()), 3),
                          "buckets": per}}

    def _forward(self, b: int) -> Any:
        """The work one bucket's graph holds: the model on ``static[:b]``. On a GPU this runs once, inside
        the capture, and its output tensor (in the graph's pool) is what replays rewrite; on the fake it
        is the host launch each replay runs, writing into the static output buffer."""
        static, module = self._static, self.module
        if self.fake:
            out = self._out

            def forward_fake() -> None:
                with torch.no_grad():
                    out[:b].copy_(module(static[:b]))

            return forward_fake

        def forward() -> None:
            with torch.no_grad():
                self._outs[b] = module(static[:b])

        return forward

    # -- serving -------------------------------------------------------------------------------------
    def static_input(self) -> Any:
        """The device buffer ``(max_batch, C, H, W)`` float32 every graph reads (GPU-DMA writes here)."""
        return self._static if self.prepared else None

    def _stream(self) -> Any:
        if self.target.stream is not None:
            return self.target.stream
        if self.fake:
            if self._own_stream is None:
                self._own_stream = Stream(self.target.device_index)
            return self._own_stream

        return torch.cuda.current_stream(self.target.device_index)

    def run(self, x: Any) -> Any:
        """Replay the graph of ``x``'s bucket on the instance's stream; returns the output's first ``n``
        rows at once (complete after an event recorded on the stream after this call). ``x``: float32
        ``(n, C, H, W)``; rows already in the static buffer (GPU-DMA's) are not copied."""
        if not self.prepared:
            raise EngineError("engine 'cudagraph' is not prepared: call prepare() before run()")
        n = check_batch(self.kind, x, self.source)
        stream = self._stream()
        if x.data_ptr() != self._static.data_ptr():
            self._copy_in(x, n, stream)
        b = bucket_of(n, self.buckets)
        self.graphs[b].replay(stream)
        self.replays += 1
        return (self._out if self.fake else self._outs[b])[:n]

    def _copy_in(self, x: Any, n: int, stream: Any) -> None:
        if self.fake:
            src = x.detach().to(torch.float32).contiguous()
            self._keep = src  # alive until the copy has run (the next run() or close() comes after it)
            runtime.cuda().cuda_memcpy_async(self._static.data_ptr(), src.data_ptr(), src.numel() * 4,
                                             stream_handle(stream))
            return

        with torch.cuda.stream(_torch_stream(stream, self.target.device_index)):
            self._static[:n].copy_(x, non_blocking=True)

    def synchronize(self, interval_us: float = 100, timeout_s: float | None = 30.0) -> None:
        """Wait, Sync-lite style (cudaEventRecord, then cudaEventQuery polling), until the last run's
        output is complete: for callers that are not an instance (whose run seam does this)."""
        if self._event is None:
            self._event = Event(self.target.device_index)
        self._event.record(stream_handle(self._stream()) if self.fake else self._stream())
        self._event.wait(interval_us, timeout_s=timeout_s)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.prepared:
            d.update(replays=self.replays, static_input_bytes=self._mem.nbytes)
        return d

    def close(self) -> None:
        """Wait for work in flight, then destroy every graph and free the static buffer."""
        graphs: dict[int, CudaGraph] = self.__dict__.get("graphs", {})
        if graphs and self.__dict__.get("replays"):
            _settle(self)
        for g in graphs.values():
            g.close()
        graphs.clear()
        self._outs = {}
        self.__dict__.get("_envs", {}).clear()
        for s in self.__dict__.get("_side", []):
            if isinstance(s, Stream):
                s.close()
        self._side = []
        self.__dict__.pop("_out", None)
        self.__dict__.pop("_static", None)
        self.__dict__.pop("module", None)
        self._keep = None
        mem = self.__dict__.pop("_mem", None)
        if mem is not None:
            mem.close()
        for name in ("_event", "_own_stream"):
            obj = self.__dict__.get(name)
            if obj is not None:
                obj.close()
                setattr(self, name, None)
        super().close()


def _settle(engine: Any) -> None:
    """Wait for the engine's last run before its buffers go. A lost context (a sticky fault) or a device
    that stopped is logged, not raised: queued work is gone with the context, and close() must finish."""
    try:
        engine.synchronize(timeout_s=60.0)
    except (CudaError, TimeoutError) as e:
        log.error("engine %s: the last run did not complete before close (%s); releasing anyway", engine.kind, e)
