"""Batch-Latency (paper V-F): which batch size of each model fits a GPU% for a given time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuprims.profile.format import Profile, Stat


def largest_batch(profile: Profile, gpu_pct: float, interval_ms: float, *, stat: Stat = "p50",
                  scale: float = 1.0, max_batch: int | None = None) -> int:
    """The largest integer batch size whose predicted latency at ``gpu_pct`` is at most ``interval_ms``.

    The prediction is ``scale * profile.latency_ms(batch, gpu_pct)`` (``scale`` carries a learned
    correction). Only batch sizes inside the measured range are considered, capped at ``max_batch``;
    returns 0 when none fits or when ``gpu_pct`` lies outside the profile's measured GPU% range (the
    profile then supports no prediction).
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    pcts = profile.gpu_pcts
    if not pcts[0] <= gpu_pct <= pcts[-1] or interval_ms <= 0:
        return 0
    hi = profile.batch_sizes[-1] if max_batch is None else min(max_batch, profile.batch_sizes[-1])
    best = 0
    for b in range(profile.batch_sizes[0], hi + 1):
        if scale * profile.latency_ms(b, gpu_pct, stat=stat) <= interval_ms:
            best = b
    return best


def batch_latency(profiles: Mapping[str, Profile] | Iterable[Profile], gpu_pct: float, interval_ms: float,
                  *, stat: Stat = "p50") -> dict[str, int]:
    """For each model, the largest batch size that completes within ``interval_ms`` at ``gpu_pct``.

    ``profiles`` is a mapping or an iterable of profiles (keys are the models' names). A model gets
    0 when even its smallest measured batch does not fit, or when ``gpu_pct`` is outside its
    measured range. Raises ValueError for ``gpu_pct`` outside (0, 100] or a negative/NaN interval.
    """
    if not 0 < gpu_pct <= 100:
        raise ValueError(f"gpu_pct must be in (0, 100], got {gpu_pct}")
    if not interval_ms >= 0:
        raise ValueError(f"interval_ms must be >= 0, got {interval_ms}")
    items = profiles.values() if isinstance(profiles, Mapping) else profiles
    return {p.model: largest_batch(p, gpu_pct, interval_ms, stat=stat) for p in items}
