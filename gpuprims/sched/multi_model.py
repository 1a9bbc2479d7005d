"""Multi-Model (paper V-D): how many instances of one model, at what GPU% each, maximise throughput."""

from __future__ import annotations

from gpuprims.profile.format import Profile, Stat


def multi_model(profile: Profile, available_pct: int, deadline_ms: float, *, batch_size: int = 1,
                stat: Stat = "p99", max_instances: int | None = None) -> tuple[int, int]:
    """(instances, pct_each) maximising throughput with every instance's latency within the deadline.

    Candidates are n = 1, 2, ... instances with ``pct_each = available_pct // n`` (as in the paper's
    Fig. 9: the share is divided evenly), as long as ``pct_each`` is inside the profile's measured
    GPU% range. Each instance serves ``batch_size`` requests per ``latency_ms(batch_size, pct_each)``
    (CSS isolates instances, so they do not slow each other), giving throughput
    ``n * batch_size * 1000 / latency`` requests/s. The candidate with the highest throughput whose
    latency (``stat``, p99 by default) is at most ``deadline_ms`` wins; ties go to fewer instances
    (less memory). Returns (0, 0) when no candidate meets the deadline. Raises ValueError for
    ``available_pct`` outside 1..100, a non-positive deadline, a batch size outside the measured range
    or ``max_instances`` < 1.
    """
    if not 1 <= available_pct <= 100:
        raise ValueError(f"available_pct must be in 1..100, got {available_pct}")
    if not deadline_ms > 0:
        raise ValueError(f"deadline_ms must be > 0, got {deadline_ms}")
    bs = profile.batch_sizes
    if not bs[0] <= batch_size <= bs[-1]:
        raise ValueError(f"model {profile.model!r}: batch_size {batch_size} is outside the measured "
                         f"range [{bs[0]}, {bs[-1]}]")
    if max_instances is not None and max_instances < 1:
        raise ValueError(f"max_instances must be >= 1, got {max_instances}")
    min_pct = profile.gpu_pcts[0]
    best: tuple[float, int, int] = (0.0, 0, 0)
    n_max = available_pct if max_instances is None else min(max_instances, available_pct)
    for n in range(1, n_max + 1):
        pct = available_pct // n
        if pct < min_pct:
            break
        if pct > profile.gpu_pcts[-1]:
            continue
        lat = profile.latency_ms(batch_size, pct, stat=stat)
        if lat > deadline_ms:
            continue
        thr = n * batch_size * 1000.0 / lat
        if thr > best[0] * (1 + 1e-9):
            best = (thr, n, pct)
    return best[1], best[2]
