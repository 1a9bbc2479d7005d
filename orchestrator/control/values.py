"""Numbers read from a record that crossed a process boundary (a heartbeat, a status reply): a count is a
non-negative integer and anything else reads as 0; a number is finite or None. Dependency-free, so the
CLI's ``status`` reads them without the statistics' numpy."""

from __future__ import annotations

import math
from typing import Any


def as_count(v: Any) -> int:
    """``v`` as a count: a positive int or float truncated, anything else (bool, NaN, text, negative) 0."""
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else 0


def as_number(v: Any) -> float | None:
    """``v`` as a finite float, or None (bool, NaN, infinity, anything not a number)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)
