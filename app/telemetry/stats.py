"""Order statistics shared by the benchmarks and reports (pure Python, no store access)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
