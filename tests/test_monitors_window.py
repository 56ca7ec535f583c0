"""Windows and percentiles over cumulative readings (pure, no clock)."""

import numpy as np
import pytest

from engine.stats import LatencyHistograms
from monitors.window import SnapshotWindow, percentile


def test_window_delta_spans_the_window_and_forgets_older_snapshots():
    w = SnapshotWindow(seconds=10)
    assert w.delta() is None
    for t in range(0, 31):
        w.push(float(t), 5.0 * t)  # a counter growing 5 per second
    elapsed, change = w.delta()
    assert elapsed == pytest.approx(10.0)
    assert change / elapsed == pytest.approx(5.0)


def test_window_on_arrays():
    w = SnapshotWindow(seconds=2)
    w.push(0.0, np.array([1, 2]))
    w.push(1.0, np.array([4, 2]))
    elapsed, change = w.delta()
    assert elapsed == 1.0 and change.tolist() == [3, 0]


@pytest.mark.parametrize("q", [0.5, 0.95, 0.99])
def test_histogram_percentiles_agree_with_exact_ones(q):
    rng = np.random.default_rng(0)
    samples = rng.lognormal(mean=np.log(0.02), sigma=0.8, size=20_000)
    h = LatencyHistograms()
    for s in samples:
        h.record("total", float(s))
    counts, total = h.snapshot()["total"]
    estimate = percentile(counts, LatencyHistograms.upper_bounds(), q)
    exact = float(np.quantile(samples, q))
    assert abs(estimate - exact) / exact < 0.05
    assert total == pytest.approx(samples.sum())


def test_windowed_percentile_reflects_only_recent_requests():
    h = LatencyHistograms()
    w = SnapshotWindow(seconds=5)
    bounds = LatencyHistograms.upper_bounds()
    for _ in range(1000):
        h.record("total", 1.0)  # an old slow period
    w.push(0.0, h.snapshot()["total"][0])
    for _ in range(100):
        h.record("total", 0.010)
    w.push(6.0, h.snapshot()["total"][0])
    w.push(7.0, h.snapshot()["total"][0])
    _, recent = w.delta()
    assert recent.sum() == 100
    assert percentile(recent, bounds, 0.99) == pytest.approx(0.010, rel=0.1)


def test_empty_distribution_has_no_percentile():
    assert percentile(np.zeros(10, dtype=np.int64), LatencyHistograms.upper_bounds()[:10], 0.5) is None
