"""``engine: auto``: at build time, the fastest engine that builds here and equals eager.

:meth:`AutoEngine.prepare` builds every candidate kind available on the backend (each through its own
cache entry), keeps those whose outputs equal eager's within the candidate's own ``tolerance`` at batch 1
and max_batch, times each briefly (``runs`` timed runs after two warm-ups, at batch 1 and at max_batch),
and picks the one with the smallest *score*: the median latency at batch 1 plus the median latency per
sample at max_batch, so light load (latency) and full batches (throughput) weigh the same. The decision
(pick, timings, why the others were dropped) is cached under a key of the model, device, candidates and
library versions: a second prepare measures nothing, it loads the picked engine from its cache.

Candidates by backend: cpu: eager, onnxruntime (cpu provider), openvino (where installed), compile; cuda:
eager, onnxruntime (cuda and tensorrt providers), and tensorrt, cudagraph and compile where those kinds
are registered. The ``candidates`` option narrows the list by kind.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gpuprims.backend import torch_device
from gpuprims.engines.base import KINDS, BuildInfo, Engine, EngineError, Progress, make_engine
from gpuprims.engines.cache import EngineCache, engine_key
from gpuprims.engines.kinds import ENGINE_KINDS

#: Every candidate (kind, options) per backend, in the order tried.
CANDIDATES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "cpu": (("eager", {}), ("onnxruntime", {"provider": "cpu"}), ("openvino", {}), ("compile", {})),
    "cuda": (("eager", {}), ("onnxruntime", {"provider": "cuda"}), ("onnxruntime", {"provider": "tensorrt"}),
             ("tensorrt", {}), ("cudagraph", {}), ("compile", {})),
}
log = logging.getLogger("gpuprims.engines")


def _label(kind: str, options: dict[str, Any]) -> str:
    return kind + "".join(f":{v}" for v in options.values())


class AutoEngine(Engine):
    """Picks and then is the fastest candidate that equals eager (see the module docstring)."""

    kind = "auto"
    spec = ENGINE_KINDS["auto"]
    #: Not used to judge anything: each candidate is held to its own tolerance; describe() gives the
    #: picked engine's.
    tolerance = (0.0, 0.0)

    def candidates(self) -> list[tuple[str, dict[str, Any]]]:
        """The (kind, options) this backend offers that are registered and pass their own check()."""
        wanted = self.options["candidates"]
        out = []
        for kind, opts in CANDIDATES[self.target.backend]:
            if kind not in KINDS or (wanted is not None and kind not in wanted):
                continue
            out.append((kind, dict(opts)))
        if not any(k == "eager" for k, _ in out):
            out.insert(0, ("eager", {}))  # always there: the reference, and the fallback
        return out

    # -- life cycle --------------------------------------------------------------------------------------
    def _prepare(self, module: Any, progress: Progress | None) -> None:
        cache = self.cache if self.cache is not None else EngineCache()
        if module is None:
            module = self.source.build_module(torch_device(self.target.backend, self.target.device_index))
        cands = self.candidates()
        key = engine_key(self, module, libraries=("onnxruntime", "onnx"),
                         extra={"candidates": [_label(k, o) for k, o in cands]})
        t0 = time.perf_counter()
        found = cache.lookup(key)
        if found is not None:
            meta = found.meta
            try:
                self.inner = make_engine(meta["picked"], self.source, self.target, meta["picked_options"],
                                         cache=cache)
                self.inner.prepare(module, progress)
            except (EngineError, KeyError, TypeError) as e:
                # the cached pick no longer loads (a library removed, a corrupt decision): decide again
                log.warning("engine 'auto' for %s: the cached pick does not load (%s); measuring again",
                            self.source.model, e)
                self._remove_decision(cache, found.path)
            else:
                self.decision = meta
                self.info = BuildInfo(fingerprint=key, cache_hit=True, load_ms=(time.perf_counter() - t0) * 1e3,
                                      artefact=str(found.path), extra={"picked": meta["picked"]})
                return
        decision = self._decide(module, cands, cache, progress)

        def build(tmp: Path) -> dict[str, Any]:
            return decision

        entry = cache.get_or_build(key, build, progress=progress)
        self.decision = decision
        self.info = BuildInfo(fingerprint=key, cache_hit=False, build_ms=(time.perf_counter() - t0) * 1e3,
                              artefact=str(entry.path), extra={"picked": decision["picked"]})

    @staticmethod
    def _remove_decision(cache: EngineCache, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def _decide(self, module: Any, cands: list[tuple[str, dict[str, Any]]], cache: EngineCache,
                progress: Progress | None) -> dict[str, Any]:
        top = self.source.max_batch
        gen = torch.Generator().manual_seed(0)
        device = next(iter(module.parameters()), torch.zeros(0)).device
        inputs = {n: torch.randn(n, *self.source.input_shape, generator=gen).to(device) for n in sorted({1, top})}
        with torch.inference_mode():
            want = {n: module(x) for n, x in inputs.items()}
        timings: dict[str, dict[str, float]] = {}
        rejected: dict[str, str] = {}
        engines: dict[str, tuple[Engine, str, dict[str, Any]]] = {}
        for i, (kind, opts) in enumerate(cands):
            label = _label(kind, opts)
            if progress is not None:
                progress(f"auto: building and timing {label} ({i + 1}/{len(cands)})", i / len(cands))
            try:
                eng = make_engine(kind, self.source, self.target, opts, cache=cache)
                eng.prepare(module, progress)
            except EngineError as e:
                rejected[label] = str(e)
                continue
            rtol, atol = getattr(eng, "tolerance_now", eng.tolerance)
            bad = next((n for n, x in inputs.items()
                        if not torch.allclose(eng.run(x).float(), want[n].float(), rtol=rtol, atol=atol)), None)
            if bad is not None:
                rejected[label] = f"differs from eager at batch {bad} beyond its tolerance (rtol={rtol}, atol={atol})"
                eng.close()
                continue
            timings[label] = {f"p50_ms_batch{n}": self._time(eng, x) for n, x in inputs.items()}
            timings[label]["score_ms"] = timings[label]["p50_ms_batch1"] + timings[label][f"p50_ms_batch{top}"] / top
            timings[label]["build_ms"] = round(eng.info.build_ms, 1)
            engines[label] = (eng, kind, opts)
        if not engines:
            raise EngineError(f"engine 'auto': no candidate built and equalled eager for {self.source.model!r}: "
                              + "; ".join(f"{k}: {v}" for k, v in rejected.items()))
        best = min(engines, key=lambda lab: timings[lab]["score_ms"])
        for label, (eng, _, _) in engines.items():
            if label != best:
                eng.close()
        self.inner, kind, opts = engines[best]
        return {"picked": kind, "picked_options": dict(self.inner.options), "picked_label": best,
                "timings": timings, "rejected": rejected}

    def _time(self, eng: Engine, x: Any) -> float:
        """Median wall time of one run in ms (two warm-ups, then ``runs`` runs)."""
        samples = []
        for i in range(self.options["runs"] + 2):
            t = time.perf_counter()
            eng.run(x)
            if i >= 2:
                samples.append((time.perf_counter() - t) * 1e3)
        return round(statistics.median(samples), 3)

    # -- serving: the picked engine ----------------------------------------------------------------------
    def run(self, x: Any) -> Any:
        if not self.prepared:
            raise EngineError("engine 'auto' is not prepared: call prepare() first")
        return self.inner.run(x)

    def static_input(self) -> Any:
        return self.inner.static_input() if self.prepared else None

    @property
    def picked(self) -> Engine | None:
        return self.__dict__.get("inner")

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        inner = self.picked
        if inner is not None:
            d.update(picked=inner.kind, picked_options=dict(inner.options), param_share=inner.uses_torch_weights,
                     tolerance=list(getattr(inner, "tolerance_now", inner.tolerance)), engine=inner.describe())
        decision = self.__dict__.get("decision")
        if decision is not None:
            d.update(timings_ms=decision["timings"], rejected=decision["rejected"])
        return d

    def close(self) -> None:
        inner = self.__dict__.pop("inner", None)
        if inner is not None:
            inner.close()
        super().close()
