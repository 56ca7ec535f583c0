"""The cluster policy plugged into Ray Serve: its custom autoscaling policy for the replicas.

Ray Serve calls this in its controller every control-loop tick with an AutoscalingContext; it
builds the pure policy's ClusterObservation from the replicas' reported numbers
(`SelftuneReplica.record_autoscaling_stats`), asks the policy at most every `interval_seconds`,
writes each decision to the audit log and the registry, and returns the replica target. Ray
Serve then starts or stops replicas (and drains the ones it stops).
"""

from __future__ import annotations

import json
import logging
import time

from policies.loader import replica_policy_from_spec
from policies.replicas import ClusterObservation, ReplicaSample

log = logging.getLogger("selftune.cluster")

IMPORT_PATH = "autotune.cluster.autoscaler:ClusterAutoscaler"


def cluster_observation(now: float, metrics: dict[str, dict]) -> ClusterObservation:
    """metric name -> {replica id -> value} (Ray's aggregated custom metrics) as the policy's input."""
    replicas = sorted({replica for values in metrics.values() for replica in values}, key=str)

    def value(name: str, replica, default=None):
        return metrics.get(name, {}).get(replica, default)

    return ClusterObservation(
        now,
        tuple(
            ReplicaSample(
                replica=getattr(r, "unique_id", str(r)),
                core_load=value("core_load", r, 0.0),
                ready_workers=value("ready_workers", r, 0.0),
                queue_depth=value("queue_depth", r, 0.0),
                p99_seconds=value("p99_seconds", r),
                rejected_rate=value("rejected_rate", r, 0.0),
                arrival_rate=value("arrival_rate", r, 0.0),
            )
            for r in replicas
        ),
    )


class ClusterAutoscaler:
    """Instantiated once per deployment by Ray Serve with the deployment's `policy_kwargs`."""

    def __init__(self, policy: dict, source: str = "cluster policy", interval_seconds: float = 2.0, audit_log: str | None = None, record=None):
        self.policy = replica_policy_from_spec(policy, source)
        self.interval = interval_seconds
        self.audit_log = audit_log
        self.record = record  # None: the registry actor (tests pass a list's append)
        self._decided_at: float | None = None
        self._target: int | None = None

    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        if self._target is not None and self._decided_at is not None and now - self._decided_at < self.interval:
            return self._target, ctx.policy_state  # Ray asks every control-loop tick; decide at the configured pace
        observation = cluster_observation(now, ctx.aggregated_metrics or {})
        current = ctx.target_num_replicas
        decision = self.policy.decide(observation, current, (ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas))
        self._decided_at, self._target = now, decision.replicas
        self._audit(observation, current, decision)
        return decision.replicas, ctx.policy_state

    def _audit(self, observation: ClusterObservation, current: int, decision) -> None:
        entry = {
            "time": observation.time,
            "replicas_before": current,
            "replicas": decision.replicas,
            "changed": decision.replicas != current,
            "reason": decision.reason,
            "observed": [
                {"replica": r.replica, "core_load": round(r.core_load, 3), "ready_workers": r.ready_workers,
                 "queue_depth": r.queue_depth, "p99_seconds": r.p99_seconds, "arrival_rate": round(r.arrival_rate, 2)}
                for r in observation.replicas
            ],
        }
        if entry["changed"]:
            log.info("cluster policy: %s", decision.reason)
        if self.audit_log:
            with open(self.audit_log, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        try:
            if self.record is not None:
                self.record(entry)
            else:
                from autotune.cluster import registry

                registry.record_decision(entry)
        except Exception:  # the registry is for people; scaling must not stop when it is missing
            log.exception("could not record a cluster decision")
