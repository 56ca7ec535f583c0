"""The controller's guardrails (pure) and its loop against a real engine."""

from __future__ import annotations

import json
import math

import pytest

from autotune.controller import HOLD, Controller, ControllerConfig, DecisionLoop, hold_key, without_holds
from autotune.guardrails import MachineLimits, constrain, effective_bounds
from engine.config import Bounds, EngineConfig, Knobs
from engine.engine import Engine
from monitors.observation import Latency, Load, Observation, WorkerObservation
from policies.base import Decision

BOUNDS = Bounds()
TWO_CORES = MachineLimits(usable_cores=2)


def test_pinned_knobs_are_kept_and_bounds_clamp():
    current = Knobs(process_count=1, max_batch_size=16)
    proposed = current.replace(max_batch_size=999, batch_timeout=0.5, process_count=2)
    knobs, notes = constrain(proposed, current, BOUNDS, TWO_CORES, pinned={"batch_timeout"})
    assert knobs.batch_timeout == current.batch_timeout
    assert knobs.max_batch_size == BOUNDS.max_batch_size[1]
    assert knobs.process_count == 2
    assert any("pinned" in n for n in notes) and any("clamped" in n for n in notes)


def test_cores_are_not_oversubscribed_and_the_unchanged_knob_gives_way():
    current = Knobs(process_count=1, threads_per_process=2)
    more_processes, notes = constrain(current.replace(process_count=2), current, BOUNDS, TWO_CORES, set())
    assert (more_processes.process_count, more_processes.threads_per_process) == (2, 1)
    assert notes
    current = Knobs(process_count=2, threads_per_process=1)
    more_threads, _ = constrain(current.replace(threads_per_process=2), current, BOUNDS, TWO_CORES, set())
    assert (more_threads.process_count, more_threads.threads_per_process) == (1, 2)
    allowed = MachineLimits(usable_cores=2, allow_oversubscription=True)
    both, notes = constrain(current.replace(threads_per_process=2), current, BOUNDS, allowed, set())
    assert (both.process_count, both.threads_per_process) == (2, 2) and not notes


def test_memory_budget_caps_workers_and_bounds_follow_the_machine():
    limits = MachineLimits(usable_cores=64, memory_budget_bytes=1000, worker_memory_bytes=300)
    knobs, notes = constrain(Knobs(process_count=8), Knobs(process_count=2), BOUNDS, limits, set())
    assert knobs.process_count == 3 and any("memory" in n for n in notes)
    narrowed = effective_bounds(BOUNDS, TWO_CORES, Knobs(threads_per_process=2))
    assert narrowed.process_count == (1, 2) and narrowed.threads_per_process == (1, 2)  # threads give way
    pinned = effective_bounds(BOUNDS, TWO_CORES, Knobs(threads_per_process=2), {"threads_per_process"})
    assert pinned.process_count == (1, 1)


# ---- the loop, on a real engine ----------------------------------------------------------------


def observation(t: float, states=("ready",), p99: float = 0.01) -> Observation:
    workers = tuple(WorkerObservation(i, None, s, 0.5, 0) for i, s in enumerate(states))
    return Observation(time=t, window_seconds=10, load=Load(arrival_rate=5, latency={"total": Latency(p99=p99, count=50)}), workers=workers)


class Propose:
    """A policy that proposes fixed knobs (or raises, or answers nonsense) — to drive the loop."""

    name = "propose"

    def __init__(self, make):
        self.make = make
        self.calls = 0

    def decide(self, obs, knobs, bounds):
        self.calls += 1
        return self.make(knobs)


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(knobs=Knobs(process_count=1, max_batch_size=8))) as eng:
        yield eng


def make_controller(engine, policy, tmp_path, **overrides):
    config = ControllerConfig(interval_seconds=1.0, cooldown_seconds=5.0, audit_log=str(tmp_path / "audit.jsonl"), limits=TWO_CORES, **overrides)
    return Controller(engine, policy, engine.config.bounds, config)


def test_a_raising_or_nonsense_policy_changes_nothing(engine, tmp_path):
    before = engine.knobs

    def boom(knobs):
        raise RuntimeError("bug in a policy")

    for make, outcome in ((boom, "policy-error"), (lambda k: None, "policy-nonsense"), (lambda k: Decision(k.replace(batch_timeout=math.nan), "nan"), "policy-nonsense")):
        controller = make_controller(engine, Propose(make), tmp_path)
        controller.on_observation(observation(100.0))
        assert engine.knobs == before
        assert controller.decisions()[-1]["outcome"] == outcome


def test_a_change_is_applied_logged_and_followed_by_a_cooldown(engine, tmp_path):
    policy = Propose(lambda k: Decision(k.replace(max_batch_size=4 if k.max_batch_size != 4 else 8), "flip the batch size"))
    controller = make_controller(engine, policy, tmp_path)
    old = engine.knobs.max_batch_size
    controller.on_observation(observation(200.0))
    assert engine.knobs.max_batch_size != old
    entry = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
    assert entry["outcome"] == "applied" and entry["reason"] == "flip the batch size"
    assert entry["old"]["max_batch_size"] == old and entry["new"]["max_batch_size"] == engine.knobs.max_batch_size
    calls = policy.calls
    controller.on_observation(observation(203.0))  # inside the cooldown: not even asked
    assert policy.calls == calls
    controller.on_observation(observation(206.0, states=("ready", "starting")))  # a worker still warming up
    assert policy.calls == calls
    controller.on_observation(observation(206.5))
    assert policy.calls == calls + 1


def test_pins_and_dry_run(engine, tmp_path):
    knobs = engine.knobs
    pinned = make_controller(engine, Propose(lambda k: Decision(k.replace(max_batch_size=2), "smaller")), tmp_path)
    pinned.pinned = lambda: {"max_batch_size"}
    pinned.on_observation(observation(300.0))
    # the pin took the move back: a hold, recorded with the policy's reason and the guardrail's note
    hold = pinned.decisions()[-1]
    assert engine.knobs == knobs and hold["outcome"] == "no-change" and hold["reason"] == "smaller"
    assert hold["new"] == hold["old"] == knobs.as_dict() and hold["proposed"]["max_batch_size"] == 2
    assert any("max_batch_size is pinned" in n for n in hold["notes"])
    dry = make_controller(engine, Propose(lambda k: Decision(k.replace(max_batch_size=2), "smaller")), tmp_path, dry_run=True)
    dry.on_observation(observation(300.0))
    assert engine.knobs == knobs
    assert dry.decisions()[-1]["outcome"] == "dry-run" and dry.decisions()[-1]["new"]["max_batch_size"] == 2


def test_holds_are_recorded_once_per_reason():
    """A policy that holds says why in the audit log, once per run of holds that differ only in
    their figures; a new reason, or the old one after another or after a change, is recorded again."""
    reasons = iter(["p99 12 ms of 500 ms: holding", "p99 n/a of 500 ms: holding", "3 of 20 samples: holding",
                    "p99 9 ms of 500 ms: holding", "p99 9 ms of 500 ms: holding", "grow", "p99 9 ms of 500 ms: holding"])

    def decide(k):
        reason = next(reasons)
        return Decision(k.replace(max_batch_size=k.max_batch_size + 1) if reason == "grow" else k, reason)

    loop = DecisionLoop(Propose(decide), BOUNDS, ControllerConfig(interval_seconds=1.0, limits=TWO_CORES))
    knobs, recorded = Knobs(max_batch_size=8), []
    for t in range(7):
        step = loop.step(observation(10.0 + 2 * t), knobs, set())
        if step.knobs is not None:
            knobs = step.knobs
        if step.entry is not None:
            recorded.append(step.entry)
    assert [(e["outcome"], e["reason"]) for e in recorded] == [
        (HOLD, "p99 12 ms of 500 ms: holding"), (HOLD, "3 of 20 samples: holding"), (HOLD, "p99 9 ms of 500 ms: holding"),
        ("applied", "grow"), (HOLD, "p99 9 ms of 500 ms: holding")]  # after a change, holding is news again
    assert all(e["new"] == e["old"] for e in recorded if e["outcome"] == HOLD)
    assert without_holds(recorded) == [recorded[-2]]
    loop.use(Propose(lambda k: Decision(k, "p99 9 ms of 500 ms: holding")))  # a reloaded policy's first hold is news
    assert loop.step(observation(30.0), knobs, set()).entry["outcome"] == HOLD and loop.step(observation(32.0), knobs, set()).entry is None
    assert hold_key("TTFT p99 1.2 s of 2 s, 10 seconds") == hold_key("TTFT p99 n/a of 2 s, 10 seconds") == "TTFT p# # of #, # seconds"
