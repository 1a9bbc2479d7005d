"""Synthetic profiles with known answers for the scheduling tests."""

from __future__ import annotations

from collections.abc import Mapping

from gpuprims.profile.format import Profile


def make_profile(model: str, latency_ms: Mapping[tuple[int, int], float], *, p99_factor: float = 1.0) -> Profile:
    """A synthetic profile from {(batch_size, gpu_pct): p50 latency ms} on a full grid."""
    points = [
        {"batch_size": b, "gpu_pct": g, "latency_p50_ms": lat, "latency_p99_ms": lat * p99_factor,
         "peak_mem_mb": 100.0 + b, "throughput_rps": b * 1000.0 / lat}
        for (b, g), lat in latency_ms.items()
    ]
    return Profile(model=model, source="synthetic", backend="cpu", device="test",
                   conditions={"input_shape": (3, 8, 8), "date": "2026-01-01"}, points=points)


def grid(model: str, by_pct: Mapping[int, Mapping[int, float]]) -> Profile:
    """A profile from {gpu_pct: {batch_size: latency_ms}}."""
    return make_profile(model, {(b, g): lat for g, row in by_pct.items() for b, lat in row.items()})
