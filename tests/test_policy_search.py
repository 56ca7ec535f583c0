"""The search policy: hill-climbing on measured goodput over a synthetic one-peak landscape."""

from __future__ import annotations

import math

import pytest
from policy_helpers import obs

from engine.config import Bounds, Knobs
from policies.search import SearchParams, SearchPolicy

SEARCH_BOUNDS = Bounds(
    process_count=(1, 4),
    threads_per_process=(1, 4),
    io_threads=(0, 4),
    batch_timeout=(0.001, 0.032),
    max_batch_size=(1, 64),
)
START = Knobs(process_count=1, threads_per_process=2, io_threads=1, max_batch_size=4, batch_timeout=0.001)
OPTIMUM = Knobs(process_count=3, threads_per_process=1, io_threads=2, max_batch_size=16, batch_timeout=0.004)


def landscape(knobs: Knobs, arrival: float) -> tuple[float, float]:
    """(completions/s, p99) of a saturated server: one peak, at OPTIMUM (4 processes above 1500/s)."""
    best_p = 3 if arrival < 1500 else 4
    capacity = (
        500
        - 60 * abs(knobs.process_count - best_p)
        - 60 * abs(knobs.threads_per_process - 1)
        - 40 * abs(math.log2(knobs.max_batch_size / 16))
        - 30 * abs(math.log2(knobs.batch_timeout / 0.004))
        - 20 * abs(knobs.io_threads - 2)
    )
    oversubscribed = max(0, knobs.process_count * knobs.threads_per_process - 4)
    return capacity, 0.3 + 0.15 * oversubscribed  # 2 threads over the 4 cores: p99 0.6 > SLO 0.5


def search(**overrides) -> SearchPolicy:
    return SearchPolicy(SearchParams(**{"slo_p99_seconds": 0.5, "settle_seconds": 2, "trial_seconds": 3, **overrides}))


def drive(policy, knobs, ticks, start=0, arrival=1000.0, log=None):
    for t in range(start, start + ticks):
        completion, p99 = landscape(knobs, arrival)
        decision = policy.decide(obs(t, arrival=arrival, completion=completion, p99=p99), knobs, SEARCH_BOUNDS)
        SEARCH_BOUNDS.validate(decision.knobs)  # every proposal inside the bounds
        if log is not None:
            log.append((t, knobs, decision))
        knobs = decision.knobs
    return knobs


def test_search_climbs_to_the_optimum_and_holds():
    policy = search()
    log = []
    knobs = drive(policy, START, 800, log=log)
    assert knobs == OPTIMUM and policy.state == "hold" and policy.best == OPTIMUM
    reached = next(t for t, _, d in log if d.knobs == OPTIMUM)
    held_from = next(t for t, _, d in log if "no neighbour" in d.reason)
    assert reached <= 200  # 8 kept steps and their rejected neighbours, 5 decisions a trial
    assert held_from <= 250 and log[held_from][2].knobs == OPTIMUM
    assert all(d.knobs == OPTIMUM for t, _, d in log if t >= held_from)  # holds: never leaves it
    assert drive(policy, knobs, 200, start=800) == OPTIMUM


def test_search_rolls_back_a_worse_trial():
    policy = search()
    log = []
    drive(policy, OPTIMUM, 200, log=log)
    rejected = [(t, d) for t, _, d in log if "rolled back" in d.reason]
    assert rejected, "every neighbour of the optimum is worse"
    assert all("raised goodput" not in d.reason for _, _, d in log)
    for t, decision in rejected:
        trial = log[t - 1][2].knobs  # what was being measured when the verdict came
        assert decision.knobs != trial
        differing = [k for k in OPTIMUM.as_dict() if getattr(decision.knobs, k) != getattr(OPTIMUM, k)]
        assert len(differing) <= 1  # back to the best, or the best's next neighbour
    assert policy.best == OPTIMUM
    assert log[-1][2].knobs == OPTIMUM and policy.state == "hold"


def test_search_penalises_a_slo_violation_smoothly():
    from policies.search import goodput

    assert goodput(obs(0, completion=100, p99=0.4), 0.5, "total") == 100
    assert goodput(obs(0, completion=100, p99=1.0), 0.5, "total") == pytest.approx(50)
    assert goodput(obs(0, completion=100, p99=0.5000001), 0.5, "total") == pytest.approx(100, rel=1e-5)


def test_search_reexplores_after_a_load_change():
    policy = search()
    knobs = drive(policy, START, 800)
    assert knobs == OPTIMUM and policy.state == "hold"
    log = []
    knobs = drive(policy, knobs, 400, start=800, arrival=2000.0, log=log)
    assert "re-exploring" in log[0][2].reason
    assert knobs == OPTIMUM.replace(process_count=4) and policy.state == "hold"


def test_search_is_deterministic_per_seed_and_respects_its_knob_list():
    runs = []
    for _ in range(2):
        log = []
        drive(search(seed=7), START, 300, log=log)
        runs.append([d.knobs for _, _, d in log])
    assert runs[0] == runs[1]
    assert search(seed=1).moves != search(seed=2).moves
    log = []
    knobs = drive(search(knobs=["max_batch_size", "batch_timeout"]), START, 400, log=log)
    assert (knobs.process_count, knobs.threads_per_process, knobs.io_threads) == (1, 2, 1)
    assert (knobs.max_batch_size, knobs.batch_timeout) == (16, 0.004)


@pytest.mark.parametrize("ticks", [3, 300])  # during the baseline, and while holding
def test_search_adopts_knobs_changed_from_outside(ticks):
    policy = search()
    drive(policy, START, ticks)
    outside = OPTIMUM.replace(max_batch_size=64)
    decision = policy.decide(obs(ticks, arrival=1000, completion=500, p99=0.3), outside, SEARCH_BOUNDS)
    assert decision.knobs == outside and policy.state == "baseline" and policy.best == outside
    assert "changed outside" in decision.reason


def test_search_keeps_only_improvements_above_the_noise_margin():
    def run(min_improvement):
        policy = search(knobs=["io_threads"], min_improvement=min_improvement)
        knobs = Knobs(io_threads=2)
        for t in range(60):
            completion = 500 + 8 * knobs.io_threads  # each extra thread: +1.6 %
            knobs = policy.decide(obs(t, arrival=1000, completion=completion, p99=0.1), knobs, SEARCH_BOUNDS).knobs
        return knobs, policy.state

    assert run(0.03) == (Knobs(io_threads=2), "hold")  # +1.6 % is noise at a 3 % margin
    assert run(0.01) == (Knobs(io_threads=4), "hold")  # climbs to the bound at a 1 % margin


def test_search_judges_a_trial_the_controller_adjusted_instead_of_adopting_it():
    def controller(knobs: Knobs) -> Knobs:
        """io_threads pinned at 1; 4 cores: process_count gives way to threads."""
        knobs = knobs.replace(io_threads=1)
        return knobs.replace(process_count=min(knobs.process_count, 4 // knobs.threads_per_process))

    policy = search()
    knobs = START
    best_capacity = []
    for t in range(800):
        completion, p99 = landscape(knobs, 1000.0)
        decision = policy.decide(obs(t, arrival=1000, completion=completion, p99=p99), knobs, SEARCH_BOUNDS)
        knobs = controller(decision.knobs)
        best_capacity.append(landscape(policy.best, 1000.0)[0])
    assert knobs == OPTIMUM.replace(io_threads=1) and policy.state == "hold" and policy.best == knobs
    assert best_capacity == sorted(best_capacity)  # a clamped trial never became the best unjudged


def test_search_load_change_during_a_trial_goes_back_to_the_best():
    policy = search()
    knobs = drive(policy, START, 7)  # baseline done at t=5, first trial running
    assert policy.state == "trial" and knobs != START
    completion, p99 = landscape(knobs, 3000.0)
    decision = policy.decide(obs(7, arrival=3000, completion=completion, p99=p99), knobs, SEARCH_BOUNDS)
    assert decision.knobs == START and policy.state == "baseline"
    assert "moved during the trial" in decision.reason
