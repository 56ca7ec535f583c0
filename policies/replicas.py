"""The cluster-level policy: how many selftune replicas (one whole engine each) to run.

Each replica tunes its own processes, threads and batching; this policy only sizes the set of
replicas from what they report, the way `threshold` sizes a replica's workers:

1. core load: each replica reports the share of its cores busy in the model (Σ over its ready
   workers of busy fraction × threads, over its usable cores). Measured on cores rather than
   workers, it does not move when the replica's own controller reshapes its workers.
   desired = ceil(Σ core load / target), unless the mean is within target ± tolerance.
2. pressure: a replica that answered 429s, whose total-latency p99 is over the SLO, or whose
   queue holds more than `backlog_per_replica` items asks for one replica more than now.
3. stabilization (policies/stabilization.py, as in `threshold`), step limits, then the
   replica range (cluster.min_replicas .. max_replicas).

Only replicas that report a ready worker count; until at least one does, the count holds.
Pure: time comes in as `ClusterObservation.time`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field

from policies.base import Params
from policies.stabilization import Stabilizer, count_reason, limit_step


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """What one replica reports, averaged by Ray Serve over its look-back window."""

    replica: str
    core_load: float
    """Σ busy fraction × threads of its ready workers / its usable cores (0..1, more when oversubscribed)."""
    ready_workers: float
    queue_depth: float = 0.0
    """Items waiting in its batcher."""
    p99_seconds: float | None = None
    """Total-latency p99 over its sampler window; None when nothing finished."""
    rejected_rate: float = 0.0
    """Requests per second it answered 429."""
    arrival_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterObservation:
    time: float
    replicas: tuple[ReplicaSample, ...]


@dataclass(frozen=True, slots=True)
class ReplicaDecision:
    replicas: int
    reason: str


class ReplicaParams(Params):
    target_core_load: float = Field(0.7, gt=0, le=2)
    """The share of the replicas' cores to keep busy in the model."""
    tolerance: float = Field(0.15, ge=0, lt=1)
    slo_p99_seconds: float | None = Field(0.5, gt=0)
    """A replica whose p99 is over this asks for one more replica; None: latency is not watched."""
    backlog_per_replica: float | None = Field(None, gt=0)
    """A replica with more queued items than this asks for one more; None: the queue is not watched."""
    scale_up_stabilization_seconds: float = Field(5.0, ge=0)
    scale_down_stabilization_seconds: float = Field(30.0, ge=0)
    max_step_up: int = Field(1, ge=1)
    max_step_down: int = Field(1, ge=1)


class ReplicaPolicy:
    kind = "replicas"

    def __init__(self, params: ReplicaParams | None = None):
        self.params = params or ReplicaParams()
        self._stabilizer = Stabilizer(self.params.scale_up_stabilization_seconds, self.params.scale_down_stabilization_seconds)

    def decide(self, observation: ClusterObservation, current: int, replica_range: tuple[int, int]) -> ReplicaDecision:
        """The replica count to run, inside `replica_range` (cluster.min_replicas .. max_replicas)."""
        p = self.params
        ready = [r for r in observation.replicas if r.ready_workers >= 1]
        if not ready:
            return ReplicaDecision(current, f"no replica reports a ready worker yet: replicas stay {current}")
        desired, comparison = self._by_load(ready, current)
        pressure = self._pressure(ready)
        if pressure and desired <= current:
            desired, comparison = current + 1, f"{comparison}; {pressure}"
        stabilized, held_by = self._stabilizer.stabilize(observation.time, current, desired)
        new = limit_step(current, stabilized, p.max_step_up, p.max_step_down)
        new = min(max(new, replica_range[0]), replica_range[1])
        return ReplicaDecision(new, count_reason(comparison, "replicas", current, desired, new, held_by))

    def _by_load(self, ready: list[ReplicaSample], current: int) -> tuple[int, str]:
        p = self.params
        total = sum(r.core_load for r in ready)
        mean = total / len(ready)
        ratio = mean / p.target_core_load
        if abs(ratio - 1) <= p.tolerance:
            return current, f"core load {mean:.2f} within target {p.target_core_load:.2f} ± {p.tolerance:.2f}"
        sign = ">" if ratio > 1 else "<"
        desired = max(1, math.ceil(total / p.target_core_load - 1e-9))  # 1e-9: 1.4 / 0.7 is exactly 2
        return desired, f"core load {mean:.2f} {sign} target {p.target_core_load:.2f} over {len(ready)} replicas"

    def _pressure(self, ready: list[ReplicaSample]) -> str:
        """Why some replica is overloaded whatever its core load says ("" when none is)."""
        p = self.params
        for r in ready:
            if r.rejected_rate > 0:
                return f"replica {r.replica} rejects {r.rejected_rate:.1f} req/s"
            if p.slo_p99_seconds is not None and r.p99_seconds is not None and r.p99_seconds > p.slo_p99_seconds:
                return f"replica {r.replica} p99 {r.p99_seconds * 1000:.0f} ms > SLO {p.slo_p99_seconds * 1000:.0f} ms"
            if p.backlog_per_replica is not None and r.queue_depth > p.backlog_per_replica:
                return f"replica {r.replica} queue {r.queue_depth:.0f} > {p.backlog_per_replica:g}"
        return ""

