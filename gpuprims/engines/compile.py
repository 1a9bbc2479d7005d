"""``engine: compile``: the model compiled by ``torch.compile`` (TorchInductor), once per batch bucket.

A compiled graph is specialised to its input shapes, and a new batch size would recompile it on the
serving path (seconds to minutes). So the engine compiles a fixed set of *buckets* at :meth:`prepare`
(powers of two up to max_batch, and max_batch itself): a batch of ``n`` is padded with zeros up to the
smallest bucket ``>= n`` and the output sliced back to ``n`` rows. Nothing compiles while serving: the
engine runs with ``torch._dynamo.config.error_on_recompile`` set, so a recompilation would be an error,
not a silent stall (tests/gpuprims/engines/test_compile.py runs every batch size 1..max_batch after
prepare and counts dynamo's compiled graphs).

Options: ``mode`` (``default`` | ``reduce-overhead`` | ``max-autotune`` | ``max-autotune-no-cudagraphs``,
torch.compile's), ``backend`` (``inductor``, the compiler, or ``aot_eager``, which traces the
model and runs the graph with eager kernels: no compile time, no speed-up, for checking a model), ``buckets`` (``pow2``: 1, 2, 4, ... max_batch; ``all``: every size 1..max_batch, no
padding, more compile time; ``max``: max_batch only, the least compile time and the most padding).

Inductor's own cache (compiled kernels, FX graphs) lives inside the engine cache root
(``<root>/inductor``, set through ``TORCHINDUCTOR_CACHE_DIR`` while :meth:`prepare` compiles), so a second start
compiles from cache; the entry itself records the buckets and the first build's time. The engine runs on
the module's own weights (they are inputs of the compiled graph, not constants), so Param-Share applies.
Threads: ``torch.set_num_threads(Target.threads)`` (the compiled C++ kernels use torch's OpenMP pool).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpuprims.backend import torch_device
from gpuprims.engines.base import BuildInfo, Engine, EngineError, ExportError, Progress
from gpuprims.engines.cache import EngineCache, engine_key
from gpuprims.engines.kinds import ENGINE_KINDS

INDUCTOR_DIR = "inductor"


def buckets_for(max_batch: int, policy: str = "pow2") -> list[int]:
    """The batch sizes compiled for ``max_batch`` under ``policy`` (ascending; the last is max_batch)."""
    if policy == "all":
        return list(range(1, max_batch + 1))
    if policy == "max":
        return [max_batch]
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


@contextlib.contextmanager
def inductor_cache_dir(path: Path) -> Iterator[None]:
    """``TORCHINDUCTOR_CACHE_DIR`` set to `path` for the block (inductor reads it when it compiles;
    both inductor engines, this one and ``gpuprims.engines.file_torch``, keep its cache in their entry)."""
    was = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if was is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = was


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class CompileEngine(Engine):
    """``torch.compile`` with batch buckets (see the module docstring)."""

    kind = "compile"
    spec = ENGINE_KINDS["compile"]
    #: float32 on the CPU, every zoo model tests/gpuprims/engines/test_equal.py covers: inductor reorders
    #: and fuses float sums, so outputs differ from eager's by rounding (measured up to ~1e-5 relative).
    tolerance = (1e-3, 1e-4)
    uses_torch_weights = True

    @property
    def buckets(self) -> list[int]:
        return buckets_for(self.source.max_batch, self.options["buckets"])

    def bucket(self, n: int) -> int:
        """The bucket a batch of ``n`` runs in: the smallest compiled size >= n."""
        for b in self.buckets:
            if b >= n >= 1:
                return b
        raise EngineError(f"engine 'compile': batch of {n} is outside 1..{self.source.max_batch} "
                          f"(max_batch of {self.source.model!r})")

    def _prepare(self, module: Any, progress: Progress | None) -> None:
        device = torch_device(self.target.backend, self.target.device_index)
        if module is None:
            module = self.source.build_module(device)
        self.module = module.eval()
        if self.target.threads:
            torch.set_num_threads(self.target.threads)
        cache = self.cache if self.cache is not None else EngineCache()
        inductor_dir = cache.root / INDUCTOR_DIR
        try:
            inductor_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise EngineError(f"engine 'compile': inductor cache directory {inductor_dir} cannot be created: "
                              f"{e}") from e
        mode = self.options["mode"] if self.options["backend"] == "inductor" else None
        self.compiled = torch.compile(self.module, backend=self.options["backend"], mode=mode, dynamic=False)
        self._device = device
        buckets = self.buckets
        # one graph per bucket: raise dynamo's per-function limit so no bucket falls back to eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, len(buckets) + 2)
        key = engine_key(self, module, libraries=())
        t0 = time.perf_counter()
        compile_ms: dict[int, float] = {}
        with inductor_cache_dir(inductor_dir):
            self._compile_buckets(buckets, compile_ms, device, progress)
        total_ms = (time.perf_counter() - t0) * 1e3

        def build(tmp: Path) -> dict[str, Any]:
            meta = {"buckets": buckets, "compile_ms": compile_ms, "mode": self.options["mode"]}
            (tmp / "compile.json").write_text(json.dumps(meta))
            return meta

        entry = cache.get_or_build(key, build, progress=progress)
        # a hit means inductor's cache (under the same root) already held these kernels when we compiled
        self.info = BuildInfo(fingerprint=entry.key, cache_hit=entry.hit, build_ms=0.0 if entry.hit else total_ms,
                              load_ms=total_ms if entry.hit else 0.0, artefact=str(inductor_dir),
                              extra={"buckets": buckets, "compile_ms": compile_ms})

    def _compile_buckets(self, buckets: list[int], compile_ms: dict[int, float], device: Any,
                         progress: Progress | None) -> None:
        """Run the compiled module once per bucket: dynamo traces and inductor compiles each shape now."""
        for i, b in enumerate(buckets):
            if progress is not None:
                progress(f"compiling {self.source.model} for batch {b} ({i + 1}/{len(buckets)})",
                         i / len(buckets))
            t = time.perf_counter()
            x = torch.zeros((b, *self.source.input_shape), device=device)
            try:
                with torch.inference_mode():
                    self.compiled(x)
            except Exception as e:
                raise ExportError(f"engine 'compile': {self.source.model!r} does not compile for batch {b}: "
                                  f"{_first_line(e)}") from e
            compile_ms[b] = round((time.perf_counter() - t) * 1e3, 1)

    @contextlib.contextmanager
    def _no_recompile(self) -> Iterator[None]:
        cfg = torch._dynamo.config
        was = cfg.error_on_recompile
        cfg.error_on_recompile = True
        try:
            yield
        finally:
            cfg.error_on_recompile = was

    def run(self, x: Any) -> Any:
        if not self.prepared:
            raise EngineError("engine 'compile' is not prepared: call prepare() first")
        n = int(x.shape[0])
        b = self.bucket(n)
        if tuple(x.shape[1:]) != self.source.input_shape:
            raise EngineError(f"engine 'compile': input of shape {tuple(x.shape[1:])} per sample; "
                              f"{self.source.model!r} was compiled for {self.source.input_shape}")
        if x.dtype != torch.float32:
            x = x.float()
        if x.device != self._device:
            x = x.to(self._device)
        if b != n:
            pad = torch.zeros((b - n, *x.shape[1:]), dtype=x.dtype, device=x.device)
            x = torch.cat([x, pad])
        with torch.inference_mode(), self._no_recompile():
            y = self.compiled(x.contiguous())
        return y[:n] if b != n else y

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tolerance": list(self.tolerance), "buckets": self.buckets}

    def close(self) -> None:
        for name in ("compiled", "module"):
            self.__dict__.pop(name, None)
        super().close()
