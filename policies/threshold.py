"""Threshold scaling of `process_count`, the way the Kubernetes Horizontal Pod Autoscaler does it.

Each decision:

1. metric: `busy_fraction` (mean share of the window the ready workers spent in the model) or
   `queue_depth` (items waiting in the batcher per ready worker).
2. desired = ceil(ready × metric / target), unless |metric / target - 1| <= tolerance, in which
   case desired = the current process_count (no change inside the band). Using the *ready*
   workers' count keeps a scale-up that is still warming up from being counted twice: two ready
   workers at 0.95 ask for 3 whether or not the third is already starting.
   With `backlog_per_worker`, a second metric as HPA takes several (the larger desired count
   wins): the batcher's queue at the moment of the observation, desired = ceil(queue /
   backlog_per_worker). A busy fraction averaged over the sampler's window shows a burst only
   after several seconds; the queue shows it at once.
3. stabilization: every desired value is remembered with its time. A scale-up goes to the
   MIN of the recommendations over the last `scale_up_stabilization_seconds` (all of them must
   ask for more), a scale-down to the MAX over the last `scale_down_stabilization_seconds` (the
   whole window must ask for less). Until a new policy has seen one full scale-down window,
   the current count counts as a recommendation too, so it never scales down on less.
4. step limits: at most `max_step_up` workers added and `max_step_down` removed per decision.
5. bounds: the result is clamped to the effective range of process_count.
6. with `spread_threads`, threads_per_process = the most threads the bounds allow (on CPU: the
   usable cores) divided by the new process_count, so the workers together use every core:
   one worker at low load gets all of them (lower latency per batch), scaling out takes
   threads away (processes of one thread each are what a small model's throughput wants).

Only process_count (and with `spread_threads` threads_per_process) changes; the rest passes through.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import Decision, Params, clamp_knob
from policies.stabilization import Stabilizer, count_reason, limit_step

_METRIC_LABEL = {"busy_fraction": "busy", "queue_depth": "queue per worker"}


class ThresholdParams(Params):
    metric: Literal["busy_fraction", "queue_depth"] = "busy_fraction"
    """`busy_fraction`: mean busy share of the ready workers (0..1); `queue_depth`: items
    waiting in the batcher per ready worker."""
    target: float = Field(0.7, gt=0)
    """The metric's value to hold: a fraction for busy_fraction, items per worker for queue_depth."""
    tolerance: float = Field(0.1, ge=0, lt=1)
    """No change while |metric / target - 1| <= tolerance."""
    scale_up_stabilization_seconds: float = Field(0.0, ge=0)
    """A scale-up takes the smallest recommendation over this many past seconds (0: act at once)."""
    scale_down_stabilization_seconds: float = Field(30.0, ge=0)
    """A scale-down takes the largest recommendation over this many past seconds."""
    max_step_up: int = Field(2, ge=1)
    """Most workers added by one decision."""
    max_step_down: int = Field(1, ge=1)
    """Most workers removed by one decision."""
    min_ready_workers: int = Field(1, ge=1)
    """Observations with fewer ready workers carry no usable metric and are ignored (hold)."""
    spread_threads: bool = False
    """Also set threads_per_process to spread the allowed threads over the workers (step 6)."""
    backlog_per_worker: float | None = Field(None, gt=0)
    """Also want ceil(queued items / this) workers (step 2); None: the metric alone."""


class ThresholdPolicy:
    """HPA-style process_count scaling on busy fraction or queue depth."""

    kind = "threshold"

    def __init__(self, params: ThresholdParams | None = None):
        self.params = params or ThresholdParams()
        self.name = self.kind
        self._stabilizer = Stabilizer(self.params.scale_up_stabilization_seconds, self.params.scale_down_stabilization_seconds)

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        p = self.params
        now, current = observation.time, knobs.process_count
        ready = sum(1 for w in observation.workers if w.state == "ready")
        if ready < p.min_ready_workers:
            return Decision(knobs, f"{ready} ready workers (< {p.min_ready_workers}): process_count stays {current}")

        value = self._metric(observation, ready)
        desired, comparison = self._desired(value, ready, current)
        backlog = self._backlog_desired(observation)
        if backlog > max(desired, current):
            desired = backlog
            comparison += f"; backlog {observation.load.queue_depth} queued > {p.backlog_per_worker:g} per worker"
        stabilized, held_by = self._stabilizer.stabilize(now, current, desired)
        new = limit_step(current, stabilized, p.max_step_up, p.max_step_down)
        new = clamp_knob(bounds, "process_count", new)
        proposal = knobs.replace(process_count=new)
        reason = count_reason(comparison, "process_count", current, desired, new, held_by)
        if p.spread_threads:
            threads = clamp_knob(bounds, "threads_per_process", bounds.threads_per_process[1] // new)
            if threads != knobs.threads_per_process:
                reason += f"; threads_per_process {knobs.threads_per_process} -> {threads} ({bounds.threads_per_process[1]} threads over {new} workers)"
            proposal = proposal.replace(threads_per_process=threads)
        return Decision(proposal, reason)

    def _metric(self, observation: Observation, ready: int) -> float:
        if self.params.metric == "busy_fraction":
            return observation.busy_fraction
        return observation.load.queue_depth / ready

    def _backlog_desired(self, observation: Observation) -> int:
        per_worker = self.params.backlog_per_worker
        if per_worker is None:
            return 0
        return math.ceil(observation.load.queue_depth / per_worker - 1e-9)

    def _desired(self, value: float, ready: int, current: int) -> tuple[int, str]:
        p = self.params
        label = _METRIC_LABEL[p.metric]
        ratio = value / p.target
        if abs(ratio - 1) <= p.tolerance:
            return current, f"{label} {value:.2f} within target {p.target:.2f} ± {p.tolerance:.2f}"
        sign = ">" if ratio > 1 else "<"
        desired = max(1, math.ceil(ready * ratio - 1e-9))  # 1e-9: 2 × 0.7 / 0.7 is exactly 2
        return desired, f"{label} {value:.2f} {sign} target {p.target:.2f} (tolerance {p.tolerance:.2f})"
