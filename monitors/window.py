"""Sliding windows over cumulative readings: rates and percentiles without sorting anything.

The engine keeps only cumulative counters and cumulative latency histograms. A window keeps
the snapshots of the last `seconds` and subtracts the oldest from the newest, as Prometheus'
rate() does, so a sample costs the same at ten requests per second or ten thousand.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class SnapshotWindow:
    def __init__(self, seconds: float):
        if seconds <= 0:
            raise ValueError("a window must be longer than 0 s")
        self.seconds = seconds
        self._snapshots: deque[tuple[float, Any]] = deque()

    def push(self, now: float, value: Any) -> None:
        self._snapshots.append((now, value))
        # keep one snapshot at or beyond the window's start, so the delta spans the whole window
        while len(self._snapshots) > 2 and self._snapshots[1][0] <= now - self.seconds:
            self._snapshots.popleft()

    def delta(self) -> tuple[float, Any] | None:
        """(elapsed seconds, newest - oldest); None until two snapshots exist."""
        if len(self._snapshots) < 2:
            return None
        (t0, v0), (t1, v1) = self._snapshots[0], self._snapshots[-1]
        if t1 <= t0:
            return None
        return t1 - t0, v1 - v0


def percentile(counts: np.ndarray, upper_bounds: np.ndarray, q: float) -> float | None:
    """The q-quantile (0..1) of a bucketed distribution, interpolated within its bucket.

    Geometric buckets get geometric interpolation; the open last bucket reports its lower edge.
    """
    total = int(counts.sum())
    if total == 0:
        return None
    rank = q * total
    cumulative = np.cumsum(counts)
    index = int(np.searchsorted(cumulative, rank, side="left"))
    index = min(index, len(counts) - 1)
    below = cumulative[index - 1] if index > 0 else 0
    inside = counts[index]
    upper = upper_bounds[index]
    lower = upper_bounds[index - 1] if index > 0 else upper / 2 ** (1 / 8)
    if not np.isfinite(upper):
        return float(lower)
    fraction = (rank - below) / inside if inside else 1.0
    fraction = min(max(fraction, 0.0), 1.0)
    return float(lower * (upper / lower) ** fraction)
