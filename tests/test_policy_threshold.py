"""The threshold policy: scaling the worker count towards a target busy fraction or queue depth."""

from __future__ import annotations

import math

import pytest
from policy_helpers import BOUNDS, obs, threshold

from engine.config import Bounds, Knobs


def test_threshold_scales_up_at_once_to_ceil_of_ratio():
    decision = threshold(target=0.7).decide(obs(0, busy=0.95, workers=2), Knobs(process_count=2), BOUNDS)
    assert decision.knobs.process_count == math.ceil(2 * 0.95 / 0.7) == 3
    assert decision.reason == "busy 0.95 > target 0.70 (tolerance 0.10): process_count 2 -> 3"


@pytest.mark.parametrize("busy", [0.64, 0.70, 0.76])
def test_threshold_holds_inside_the_tolerance_band(busy):
    policy = threshold(target=0.7, tolerance=0.1, scale_down_stabilization_seconds=0)
    for t in range(5):
        decision = policy.decide(obs(t, busy=busy, workers=3), Knobs(process_count=3), BOUNDS)
        assert decision.knobs.process_count == 3
    assert "within target" in decision.reason


def test_threshold_counts_ready_workers_so_a_starting_one_is_not_asked_for_twice():
    # 2 ready at 0.95 want 3; the third is already starting: nothing more to add.
    decision = threshold(target=0.7).decide(obs(0, busy=0.95, workers=3, ready=2), Knobs(process_count=3), BOUNDS)
    assert decision.knobs.process_count == 3


def test_threshold_scale_down_waits_for_the_stabilization_window():
    policy = threshold(target=0.7, scale_down_stabilization_seconds=30)
    knobs = Knobs(process_count=4)
    for t in range(60):  # steady at target
        knobs = policy.decide(obs(t, busy=0.7, workers=4), knobs, BOUNDS).knobs
    assert knobs.process_count == 4
    first_change = None
    for t in range(60, 120):  # busy drops at t = 60
        decision = policy.decide(obs(t, busy=0.2, workers=knobs.process_count), knobs, BOUNDS)
        if t == 70:
            assert decision.knobs.process_count == 4
            assert "scale-down stabilization" in decision.reason
        if decision.knobs != knobs and first_change is None:
            first_change = t
        knobs = decision.knobs
    assert first_change == 90  # the window [60, 90] holds only low recommendations
    assert knobs.process_count < 4


def test_threshold_new_policy_does_not_scale_down_before_one_full_window():
    policy = threshold(target=0.7, scale_down_stabilization_seconds=30)
    knobs = Knobs(process_count=4)
    for t in range(30):
        assert policy.decide(obs(t, busy=0.1, workers=4), knobs, BOUNDS).knobs == knobs
    assert policy.decide(obs(30, busy=0.1, workers=4), knobs, BOUNDS).knobs.process_count == 3


def test_threshold_flapping_load_does_not_flap_the_worker_count():
    policy = threshold(target=0.7, scale_down_stabilization_seconds=30)
    knobs = Knobs(process_count=2)
    counts = []
    for t in range(300):
        work = 1.9 if (t // 5) % 2 == 0 else 0.7  # worker-equivalents of work, flipping every 5 s
        n = knobs.process_count
        knobs = policy.decide(obs(t, busy=min(1.0, work / n), workers=n), knobs, BOUNDS).knobs
        counts.append(knobs.process_count)
    changes = [(a, b) for a, b in zip(counts, counts[1:]) if a != b]
    assert counts[0] == 3  # scaled up at the first busy sample
    assert changes == []  # and then never moved again


def test_threshold_step_limits():
    up = threshold(target=0.25).decide(obs(0, busy=1.0, workers=2), Knobs(process_count=2), BOUNDS)
    assert up.knobs.process_count == 4  # wants 8, max_step_up 2
    assert "wants 8" in up.reason
    down = threshold(target=0.7, scale_down_stabilization_seconds=0, max_step_down=1)
    knobs = Knobs(process_count=8)
    knobs = down.decide(obs(0, busy=0.05, workers=8), knobs, BOUNDS).knobs
    assert knobs.process_count == 7  # wants 1
    wide = threshold(target=0.25, max_step_up=10).decide(obs(0, busy=1.0, workers=2), Knobs(process_count=2), BOUNDS)
    assert wide.knobs.process_count == 8


def test_threshold_respects_bounds():
    narrow = Bounds(process_count=(1, 3))
    up = threshold(target=0.25).decide(obs(0, busy=1.0, workers=2), Knobs(process_count=2), narrow)
    assert up.knobs.process_count == 3
    down = threshold(target=0.7, scale_down_stabilization_seconds=0)
    assert down.decide(obs(0, busy=0.01, workers=1), Knobs(process_count=1), narrow).knobs.process_count == 1


def test_threshold_ignores_observations_without_ready_workers():
    decision = threshold().decide(obs(0, busy=1.0, workers=2, ready=0), Knobs(process_count=2), BOUNDS)
    assert decision.knobs.process_count == 2
    assert "ready workers" in decision.reason


def test_threshold_on_queue_depth_per_worker():
    policy = threshold(metric="queue_depth", target=4)
    decision = policy.decide(obs(0, workers=2, queue_depth=20), Knobs(process_count=2), BOUNDS)
    assert decision.knobs.process_count == 4  # wants ceil(20 / 4) = 5, max_step_up 2
    assert decision.reason.startswith("queue per worker 10.00 > target 4.00")


def test_threshold_backlog_scales_up_before_the_busy_window_shows_the_burst():
    two_cores = Bounds(process_count=(1, 2), threads_per_process=(1, 2))
    knobs = Knobs(process_count=1, threads_per_process=2)
    policy = threshold(target=0.75, spread_threads=True, backlog_per_worker=16)
    calm = policy.decide(obs(0, busy=0.3, workers=1, queue_depth=10), knobs, two_cores)
    assert calm.knobs == knobs  # 10 queued: no backlog, busy low
    burst = policy.decide(obs(2, busy=0.3, workers=1, queue_depth=40), knobs, two_cores)
    assert (burst.knobs.process_count, burst.knobs.threads_per_process) == (2, 1)
    assert "backlog 40 queued > 16 per worker" in burst.reason
    assert threshold(target=0.75).decide(obs(2, busy=0.3, workers=1, queue_depth=40), knobs, two_cores).knobs == knobs


def test_threshold_scale_up_stabilization_takes_the_min_over_the_window():
    policy = threshold(target=0.7, scale_up_stabilization_seconds=10)
    knobs = Knobs(process_count=2)
    knobs = policy.decide(obs(0, busy=0.7, workers=2), knobs, BOUNDS).knobs
    for t in range(1, 10):
        knobs = policy.decide(obs(t, busy=0.95, workers=2), knobs, BOUNDS).knobs
        assert knobs.process_count == 2, t  # the calm sample at t=0 is still in the window
    assert policy.decide(obs(11, busy=0.95, workers=2), knobs, BOUNDS).knobs.process_count == 3


def test_threshold_spreads_the_allowed_threads_over_the_workers():
    two_cores = Bounds(process_count=(1, 2), threads_per_process=(1, 2))
    policy = threshold(target=0.75, spread_threads=True, scale_down_stabilization_seconds=0)
    up = policy.decide(obs(0, busy=0.95, workers=1), Knobs(process_count=1, threads_per_process=2), two_cores)
    assert (up.knobs.process_count, up.knobs.threads_per_process) == (2, 1)
    assert "threads_per_process 2 -> 1" in up.reason
    down = policy.decide(obs(1, busy=0.1, workers=2), up.knobs, two_cores)
    assert (down.knobs.process_count, down.knobs.threads_per_process) == (1, 2)
    plain = threshold(target=0.75).decide(obs(0, busy=0.95, workers=1), Knobs(process_count=1, threads_per_process=2), two_cores)
    assert plain.knobs.threads_per_process == 2
