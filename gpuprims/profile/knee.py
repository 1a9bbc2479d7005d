"""The knee GPU%: the share beyond which a model's latency stops improving meaningfully (paper IV-C)."""

from __future__ import annotations

from gpuprims.profile.format import Profile, Stat


def knee(profile: Profile, batch_size: int, *, tolerance: float = 0.10, stat: Stat = "p50") -> int:
    """The smallest integer GPU% whose latency is within ``tolerance`` of the latency at full share.

    Precisely: with ``L(p)`` the interpolated latency at ``batch_size`` and GPU% ``p`` and ``p_max``
    the largest measured GPU% (normally 100), the knee is the smallest integer ``p`` in the measured
    range with ``L(p) <= (1 + tolerance) * L(p_max)``. Giving a model more than its knee buys at most
    ``tolerance`` (default 10%) of latency. Raises ValueError for a batch size outside the measured
    range or a tolerance outside [0, 10].
    """
    if not 0.0 <= tolerance <= 10.0:
        raise ValueError(f"tolerance must be in [0, 10] (a fraction of the full-share latency), got {tolerance}")
    pcts = profile.gpu_pcts
    if not profile.batch_sizes[0] <= batch_size <= profile.batch_sizes[-1]:
        raise ValueError(f"model {profile.model!r}: batch_size {batch_size} is outside the measured range "
                         f"[{profile.batch_sizes[0]}, {profile.batch_sizes[-1]}]")
    limit = (1.0 + tolerance) * profile.latency_ms(batch_size, pcts[-1], stat=stat)
    for p in range(pcts[0], pcts[-1] + 1):
        # A tiny epsilon so that a point exactly on the limit counts despite float rounding.
        if profile.latency_ms(batch_size, p, stat=stat) <= limit * (1 + 1e-12):
            return p
    return pcts[-1]
