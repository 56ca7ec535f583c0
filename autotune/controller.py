"""The controller: every interval, observation -> policy -> guardrails -> engine.apply().

It listens to the sampler (each new Observation) and acts at most every `interval_seconds`.
Guardrails: one structural change (process_count) in flight at a time, a cooldown after each
change, bounds from the machine, pinned knobs untouched, and fail-static: a policy that
raises or answers nonsense is logged and the last good knobs stay. Every decision that
changes something, or fails, is appended to an audit log (JSONL) and kept for
GET /admin/decisions.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from autotune.guardrails import MachineLimits, constrain, effective_bounds, is_sane
from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import Policy

log = logging.getLogger("selftune.controller")

HOLD = "no-change"
"""The outcome of a decision that changed nothing (the policy held, or the guardrails took its move back)."""


def without_holds(decisions: list[dict]) -> list[dict]:
    """The decisions that did something: changes, dry runs, failures, reloads."""
    return [d for d in decisions if d.get("outcome") != HOLD]


def hold_key(reason: str) -> str:
    """A hold's reason with its figures masked (numbers with their unit, and "n/a" for a figure not
    measured): holds that differ only in the figures they quote are one run of holds, recorded once
    (a policy that holds for an hour logs why once, not 720 times)."""
    return re.sub(r"n/a|\d+(?:\.\d+)?(?:\s?(?:ms|s)\b)?", "#", reason)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    interval_seconds: float = 5.0
    """Decide at most this often."""
    cooldown_seconds: float = 10.0
    """After a change, wait this long before the next decision (let the system settle)."""
    dry_run: bool = False
    """Decide and log, apply nothing."""
    audit_log: str | None = None
    """JSONL file every decision is appended to; None keeps them in memory only."""
    limits: MachineLimits = MachineLimits(usable_cores=1)
    keep_decisions: int = 1000


@dataclass(frozen=True, slots=True)
class Step:
    """What one turn of the loop concluded: knobs to apply (or None) and what to record."""

    knobs: Knobs | None
    entry: dict | None


class DecisionLoop:
    """The controller's decision path with time passed in: the live Controller and the
    simulator both drive this one object.

    Interval, one structural change at a time, fail-static on a policy that raises or answers
    nonsense, the guardrails, and a cooldown once a change is applied.
    """

    def __init__(self, policy: Policy, bounds: Bounds, config: ControllerConfig):
        self.policy = policy
        self.bounds = bounds
        self.config = config
        self.next_decision_at = 0.0
        self.calls = 0
        self._last_hold: str | None = None
        """hold_key of the last hold recorded, if nothing else was since: the next hold with the same key is not."""

    def step(self, observation: Observation, current: Knobs, pinned: set[str]) -> Step:
        now = observation.time
        if now < self.next_decision_at or self._structural_change_in_flight(observation):
            return Step(None, None)
        self.next_decision_at = now + self.config.interval_seconds
        self.calls += 1
        limits = self._limits(observation)
        bounds = effective_bounds(self.bounds, limits, current, pinned)
        try:
            decision = self.policy.decide(observation, current, bounds)
        except Exception as exc:
            log.exception("policy %s raised; keeping %s", self.policy.name, current)
            self._last_hold = None
            return Step(None, self.entry(observation, current, None, None, "policy-error", f"{type(exc).__name__}: {exc}"))
        if not is_sane(getattr(decision, "knobs", None)):
            log.error("policy %s answered nonsense (%r); keeping the knobs", self.policy.name, decision)
            self._last_hold = None
            return Step(None, self.entry(observation, current, None, None, "policy-nonsense", repr(decision)[:500]))
        knobs, notes = constrain(decision.knobs, current, self.bounds, limits, pinned)
        if knobs == current:
            return Step(None, self._hold(observation, current, decision, notes))
        self._last_hold = None  # holding after a change is news again
        outcome = "dry-run" if self.config.dry_run else "applied"
        return Step(knobs, self.entry(observation, current, decision.knobs, knobs, outcome, decision.reason, notes))

    def use(self, policy: Policy) -> None:
        """Decide with `policy` from now on (a reload): its first hold is news, whatever the last one said."""
        self.policy, self._last_hold = policy, None

    def applied(self, now: float) -> None:
        """A change landed: no decision until the cooldown is over."""
        self.next_decision_at = now + max(self.config.interval_seconds, self.config.cooldown_seconds)

    def _hold(self, observation: Observation, current: Knobs, decision, notes: list[str]) -> dict | None:
        """The audit line of a hold, or None when the last hold recorded gave the same reason."""
        reason = "; ".join([decision.reason, *notes]) if notes else decision.reason
        key = hold_key(reason)
        if key == self._last_hold:
            return None
        self._last_hold = key
        return self.entry(observation, current, decision.knobs, current, HOLD, decision.reason, notes)

    def _structural_change_in_flight(self, observation: Observation) -> bool:
        """A worker still warming up or draining: wait until the last change has landed."""
        return any(w.state in ("starting", "draining") for w in observation.workers)

    def _limits(self, observation: Observation) -> MachineLimits:
        uss = [w.uss_bytes for w in observation.workers if w.uss_bytes]
        if uss and self.config.limits.memory_budget_bytes:
            return dataclasses.replace(self.config.limits, worker_memory_bytes=max(uss))
        return self.config.limits

    def entry(self, obs: Observation, old: Knobs, proposed, applied, outcome: str, reason: str, notes=()) -> dict:
        """An audit-log line: the observation in brief, old -> new knobs, the reason in words."""
        total = obs.load.latency.get("total")
        return {
            "at": round(obs.time, 3),
            "policy": self.policy.name,
            "outcome": outcome,
            "reason": reason,
            "notes": list(notes),
            "old": old.as_dict(),
            "proposed": proposed.as_dict() if proposed is not None else None,
            "new": applied.as_dict() if applied is not None else None,
            "observation": {
                "arrival_rate": round(obs.load.arrival_rate, 3),
                "completion_rate": round(obs.load.completion_rate, 3),
                "p99_seconds": None if total is None or total.p99 is None else round(total.p99, 5),
                "busy_fraction": round(obs.busy_fraction, 3),
                "queue_depth": obs.load.queue_depth,
                "batch_size": round(obs.load.batch_size, 2),
                "workers": len(obs.workers),
                **_generation_entry(obs),
            },
        }


class Controller:
    """The live loop: a DecisionLoop driven by the sampler, applying through engine.apply."""

    def __init__(
        self,
        engine,
        policy: Policy,
        bounds: Bounds,
        config: ControllerConfig,
        pinned: Callable[[], set[str]] = set,
        load_policy: Callable[[], Policy] | None = None,
    ):
        self.engine = engine
        self.loop = DecisionLoop(policy, bounds, config)
        self.config = config
        self.pinned = pinned
        self.load_policy = load_policy
        self.reload_requested = False
        """Set by SIGHUP's handler; the next observation reloads the policy file."""
        self._lock = threading.Lock()
        self._decisions: collections.deque[dict] = collections.deque(maxlen=config.keep_decisions)

    @property
    def policy(self) -> Policy:
        return self.loop.policy

    # ---- policy file -----------------------------------------------------------------------

    def reload(self) -> str:
        """Re-read the policy file; a bad file raises (PolicyError) and the running policy stays."""
        if self.load_policy is None:
            raise RuntimeError("this controller was not started from a policy file")
        policy = self.load_policy()
        with self._lock:
            old = self.loop.policy.name
            self.loop.use(policy)
        self._record({"outcome": "policy-reloaded", "reason": f"policy {old} -> {policy.name}"})
        log.info("policy reloaded: %s -> %s", old, policy.name)
        return policy.name

    # ---- the loop body -----------------------------------------------------------------------

    def on_observation(self, observation: Observation) -> None:
        if self.reload_requested:
            self.reload_requested = False
            try:
                self.reload()
            except Exception as exc:
                log.error("policy reload failed; the running policy stays: %s", exc)
                self._record({"outcome": "policy-reload-failed", "reason": str(exc)})
        with self._lock:
            current = self.engine.knobs
            step = self.loop.step(observation, current, self.pinned())
            if step.knobs is not None and not self.config.dry_run:
                try:
                    self.engine.apply(step.knobs)
                except Exception as exc:
                    log.exception("applying %s failed", step.knobs)
                    step = Step(None, {**step.entry, "outcome": "apply-failed", "reason": f"{step.entry['reason']}; {exc}"})
                else:
                    self.loop.applied(observation.time)
                    log.info("autotune: %s (%s)", _diff(current, step.knobs), step.entry["reason"])
            if step.entry is not None:
                self._record(step.entry)

    # ---- audit -------------------------------------------------------------------------------

    def _record(self, entry: dict) -> None:
        entry = {"time": time.time(), **entry}
        self._decisions.append(entry)
        if self.config.audit_log:
            with open(self.config.audit_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def decisions(self, limit: int = 100) -> list[dict]:
        return list(self._decisions)[-limit:]


def _generation_entry(obs: Observation) -> dict:
    """TTFT and ITL p99s and the preemptions, for a generating engine's audit lines."""
    out = {}
    for stage in ("ttft", "itl"):
        latency = obs.load.latency.get(stage)
        if latency is not None and latency.p99 is not None:
            out[f"{stage}_p99_seconds"] = round(latency.p99, 5)
    if out:
        out["preemptions"] = sum(w.preemptions for w in obs.workers)
    return out


def _diff(old: Knobs, new: Knobs) -> str:
    changes = [f"{k} {v} -> {getattr(new, k)}" for k, v in old.as_dict().items() if getattr(new, k) != v]
    return ", ".join(changes)
