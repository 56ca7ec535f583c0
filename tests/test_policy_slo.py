"""The slo policy: a fitted batch-latency model picks max_batch_size and batch_timeout within the SLO."""

from __future__ import annotations

import random

import pytest
from policy_helpers import BOUNDS, obs

from engine.config import Knobs
from policies.slo import SloParams, SloPolicy

A, B = 0.010, 0.002  # the true model: 10 ms + 2 ms per item


def slo(**overrides) -> SloPolicy:
    return SloPolicy(SloParams(**{"slo_p99_seconds": 0.2, **overrides}))


def feed_model(policy: SloPolicy, knobs: Knobs, points: int = 40, arrival: float = 500.0, noise: float = 0.01):
    rng = random.Random(1)
    decision = None
    for i in range(points):
        size = 1 + (i * 7) % 32
        seconds = (A + B * size) * (1 + rng.uniform(-noise, noise))
        decision = policy.decide(obs(i, arrival=arrival, batch_size=size, model_mean=seconds), knobs, BOUNDS)
    return decision


def test_slo_holds_until_the_fit_has_enough_points():
    policy = slo(min_points=5)
    knobs = Knobs(process_count=2, max_batch_size=16, batch_timeout=0.005)
    for i in range(4):
        decision = policy.decide(obs(i, arrival=500, batch_size=1 + 3 * i, model_mean=A + B * (1 + 3 * i)), knobs, BOUNDS)
        assert decision.knobs == knobs and "holding" in decision.reason
    same_size = slo(min_points=2)
    for i in range(10):
        decision = same_size.decide(obs(i, arrival=500, batch_size=8, model_mean=A + 8 * B), knobs, BOUNDS)
    assert decision.knobs == knobs  # no spread in batch size: the slope is unknown


def test_slo_drops_a_wait_that_gathers_nothing():
    """2 requests/s against a 100-ms wait: every batch holds one item, the sizes never vary and
    the fit cannot learn a slope, but the wait plainly buys nothing."""
    policy = slo()
    knobs = Knobs(process_count=2, max_batch_size=32, batch_timeout=0.1)
    first = policy.decide(obs(0, arrival=2, batch_size=1.0, model_mean=0.02, batches=[(1, 0.02)] * 20), knobs, BOUNDS)
    assert first.knobs == knobs  # one observation is not yet a fit
    decision = policy.decide(obs(2, arrival=2, batch_size=1.0, model_mean=0.02, batches=[(1, 0.02)] * 20), knobs, BOUNDS)
    assert decision.knobs == knobs.replace(batch_timeout=0.0)
    assert "waiting gathers nothing" in decision.reason
    mixed = slo()
    for t in (0, 2):
        decision = mixed.decide(obs(t, arrival=500, batch_size=1.5, model_mean=0.02, batches=[(1, 0.02), (2, 0.021)] * 10), knobs, BOUNDS)
    assert "waiting gathers nothing" not in decision.reason  # batches of two: the wait does gather something
    size = decision.knobs.max_batch_size  # 19 ms + 1 ms per item: 9 covers 1.2 × 500/s on 2 workers
    assert size == 9 and decision.knobs.batch_timeout == pytest.approx((size - 1) / 500)


def test_slo_recovers_the_batch_latency_model():
    policy = slo()
    feed_model(policy, Knobs(process_count=2))
    assert policy.fit.intercept == pytest.approx(A, rel=0.03)
    assert policy.fit.slope == pytest.approx(B, rel=0.03)


def test_slo_fits_batch_time_per_batch_not_per_request():
    """The per-request model latency weighs a batch by its items: with mixed sizes its mean is the
    big batches' time, paired with a small mean size. The fit takes the batches themselves."""
    policy = slo()
    rng = random.Random(2)
    for i in range(40):
        small, full = rng.randint(5, 15), rng.randint(1, 4)  # batches of 1 and of 32 in one window
        size = (small + 32 * full) / (small + full)
        per_request = (small * (A + B) + full * 32 * (A + 32 * B)) / (small + 32 * full)
        window = [(1, A + B)] * small + [(32, A + 32 * B)] * full
        policy.decide(obs(i, arrival=500, batch_size=size, model_mean=per_request, batches=window), Knobs(process_count=2), BOUNDS)
    assert policy.fit.intercept == pytest.approx(A, rel=0.05)
    assert policy.fit.slope == pytest.approx(B, rel=0.05)


def test_slo_learns_from_batch_sizes_that_vary_within_a_steady_window():
    """Long inputs never fill a batch: every window's mean size is ~1.4, so a fit on window means
    never learns the slope and a long wait (here the 100-ms seed) would stay for good. The
    batches themselves (1, 2, 3 items) carry the slope, and the wait drops to the fixed cost."""
    a, b = 0.002, 0.060  # 60 ms per item: batching buys next to nothing
    policy = slo(slo_p99_seconds=0.5)
    knobs = Knobs(process_count=2, max_batch_size=16, batch_timeout=0.1)
    rng = random.Random(3)
    decision = None
    for i in range(12):
        window = [(n, (a + b * n) * (1 + rng.uniform(-0.05, 0.05))) for n in rng.choices((1, 1, 1, 2, 3), k=40)]
        mean = sum(n for n, _ in window) / len(window)
        decision = policy.decide(obs(i, arrival=15, batch_size=mean, model_mean=0.1, batches=window), knobs, BOUNDS)
    assert policy.fit.slope == pytest.approx(b, rel=0.1)
    assert decision.knobs.batch_timeout <= 0.01


def test_slo_picks_the_smallest_batch_meeting_the_arrival_rate_within_the_budget():
    policy = slo(headroom=0.2, budget_fraction=0.5)
    knobs = Knobs(process_count=2, max_batch_size=64, batch_timeout=0.05)
    decision = feed_model(policy, knobs, arrival=500.0)
    size, timeout = decision.knobs.max_batch_size, decision.knobs.batch_timeout

    def capacity(b):
        return 2 * b / (A + B * b)

    assert capacity(size) >= 500 * 1.2 > capacity(size - 1)
    assert size == 8
    # the time to gather 8 (14 ms) is more than a batch's fixed cost (10 ms): wait no longer than that
    assert timeout == pytest.approx(A, rel=0.05)
    assert timeout + (A + B * size) <= 0.2 * 0.5
    assert decision.knobs.process_count == 2  # left to other policies


def test_slo_budget_caps_the_timeout():
    policy = slo(slo_p99_seconds=0.06, budget_fraction=0.5)  # 30 ms for wait + service
    decision = feed_model(policy, Knobs(process_count=2, max_batch_size=64), arrival=500.0)
    size, timeout = decision.knobs.max_batch_size, decision.knobs.batch_timeout
    assert size == 8
    assert timeout < (size - 1) / 500
    assert timeout + A + B * size <= 0.03 + 1e-4


def test_slo_capacity_short_takes_the_largest_batch_within_budget():
    policy = slo(slo_p99_seconds=0.2, budget_fraction=0.5)  # service(B) <= 100 ms: B <= 45
    decision = feed_model(policy, Knobs(process_count=2, max_batch_size=64), arrival=2000.0)
    assert decision.knobs.max_batch_size in (44, 45)
    assert "capacity short" in decision.reason


def test_slo_can_leave_max_batch_size_to_another_policy():
    policy = slo(tune_batch_size=False)
    decision = feed_model(policy, Knobs(process_count=2, max_batch_size=32, batch_timeout=0.05), arrival=500.0)
    assert decision.knobs.max_batch_size == 32
    assert decision.knobs.batch_timeout == pytest.approx(A, rel=0.05)  # the fixed cost caps the wait for 8


def test_slo_waits_for_a_batch_only_as_long_as_gathering_it_takes():
    policy = slo()
    decision = feed_model(policy, Knobs(process_count=2, max_batch_size=64, batch_timeout=0.05), arrival=300.0)
    size = decision.knobs.max_batch_size
    assert 1 < size and (size - 1) / 300 < A  # gathering is quicker than the fixed cost
    assert decision.knobs.batch_timeout == pytest.approx((size - 1) / 300, rel=0.05)


def test_slo_low_load_needs_no_wait():
    policy = slo()
    decision = feed_model(policy, Knobs(process_count=2, max_batch_size=32, batch_timeout=0.05), arrival=5.0)
    assert decision.knobs.max_batch_size == 1
    assert decision.knobs.batch_timeout == 0.0
