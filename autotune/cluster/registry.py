"""The cluster's view for people: which replicas run where, with which knobs, and the cluster
policy's decisions, kept by one small named actor and served at /cluster/stats and /cluster/metrics
by every replica.
"""

from __future__ import annotations

import os
import time
from collections import deque

import ray
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

NAME = "selftune-registry"
NAMESPACE = "selftune"
STALE_SECONDS = 10.0
"""A replica that has not reported for this long is gone (dead, or scaled away)."""


class Registry:
    def __init__(self):
        self.replicas: dict[str, dict] = {}
        self.decisions: deque[dict] = deque(maxlen=200)

    def report(self, info: dict) -> None:
        self.replicas[info["replica"]] = info

    def decision(self, entry: dict) -> None:
        self.decisions.append(entry)

    def snapshot(self) -> dict:
        now = time.time()
        live = [r for r in self.replicas.values() if now - r["reported_at"] <= STALE_SECONDS]
        last = self.decisions[-1] if self.decisions else None
        return {
            "replicas": sorted(live, key=lambda r: r["replica"]),
            "target_replicas": last["replicas"] if last else None,
            "decisions": list(self.decisions)[-50:],
        }


def handle():
    """The registry actor, created by whoever asks first (it takes no CPU)."""
    actor = ray.remote(Registry).options(name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0)
    return actor.remote()


def report(info: dict) -> None:
    handle().report.remote(info)  # fire and forget: the replica never waits on the registry


def record_decision(entry: dict) -> None:
    handle().decision.remote(entry)


def replica_identity() -> dict:
    from ray import serve

    context = ray.get_runtime_context()
    return {
        "replica": serve.get_replica_context().replica_id.unique_id,
        "node": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


def prometheus_text(snapshot: dict) -> bytes:
    registry = CollectorRegistry()
    registry.register(_Collector(snapshot))
    return generate_latest(registry)


class _Collector:
    def __init__(self, snapshot: dict):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot
        yield _gauge("selftune_cluster_replicas", "Replicas reporting now.", [([], len(s["replicas"]))])
        if s["target_replicas"] is not None:
            yield _gauge("selftune_cluster_target_replicas", "The cluster policy's last target.", [([], s["target_replicas"])])
        for name, doc in REPLICA_GAUGES.items():
            samples = [([r["replica"], r["node"]], _replica_value(r, name)) for r in s["replicas"]]
            yield _gauge(f"selftune_cluster_replica_{name}", doc, samples, ["replica", "node"])


REPLICA_GAUGES = {
    "process_count": "Worker processes of the replica.",
    "threads_per_process": "Torch threads per worker of the replica.",
    "max_batch_size": "Batch size limit of the replica.",
    "core_load": "Share of the replica's cores busy in the model.",
    "arrival_rate": "Requests per second arriving at the replica.",
}


def _replica_value(replica: dict, name: str) -> float:
    return replica["knobs"][name] if name in replica["knobs"] else replica["observed"].get(name, 0.0)


def _gauge(name: str, doc: str, samples, label_names=()):
    family = GaugeMetricFamily(name, doc, labels=list(label_names))
    for labels, value in samples:
        family.add_metric(labels, float(value))
    return family


def install_routes(app: FastAPI) -> None:
    """/cluster/stats (JSON) and /cluster/metrics (Prometheus) on a replica's app."""

    @app.get("/cluster/stats", include_in_schema=False)
    async def cluster_stats():
        return await handle().snapshot.remote()

    @app.get("/cluster/metrics", include_in_schema=False)
    async def cluster_metrics():
        snapshot = await handle().snapshot.remote()
        return Response(prometheus_text(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8")
