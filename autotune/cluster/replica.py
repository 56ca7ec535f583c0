"""One selftune replica on a Ray cluster: a Ray Serve deployment whose replica owns a whole engine.

The replica process is the engine's front (it forks the zygote, which forks the workers) and
serves the same FastAPI app as `selftune serve`, through Ray Serve's ingress; its own
controller tunes processes, threads and batching on its node exactly as on one host. It tells
Ray Serve's autoscaler what the cluster policy needs (`record_autoscaling_stats`) and the
registry what the cluster's /stats shows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from autotune.cluster import registry
from autotune.cluster.nodes import local_node_cpus
from autotune.server import StartupError, build_app, start_engine
from autotune.settings import ServerConfig
from monitors.observation import Observation

log = logging.getLogger("selftune.cluster")


def core_load(observation: Observation, threads_per_process: int, usable_cores: int) -> float:
    """Σ busy fraction of the ready workers × their torch threads, over the usable cores: how much
    of the replica's CPU the model keeps busy, whatever shape its own controller gave the workers."""
    busy = sum(w.busy_fraction for w in observation.workers if w.state == "ready")
    return busy * threads_per_process / max(1, usable_cores)


def autoscaling_stats(observation: Observation | None, usable_cores: int, knobs) -> dict[str, float]:
    """The numbers a replica reports to Ray Serve's autoscaler (floats only, averaged by Ray)."""
    stats = {"process_count": float(knobs.process_count), "threads_per_process": float(knobs.threads_per_process)}
    if observation is None:
        return {**stats, "ready_workers": 0.0}
    load = observation.load
    total = load.latency.get("total")
    stats.update(
        ready_workers=float(sum(1 for w in observation.workers if w.state == "ready")),
        core_load=core_load(observation, knobs.threads_per_process, usable_cores),
        queue_depth=float(load.queue_depth),
        arrival_rate=load.arrival_rate,
        rejected_rate=load.rejected_rate,
    )
    if total is not None and total.p99 is not None:
        stats["p99_seconds"] = total.p99  # absent, not 0, when nothing finished: 0 would read as "fast"
    return stats


class SelftuneReplica:
    """The deployment's class (wrapped by `autotune.cluster.app.deployment`)."""

    def __init__(self, config: dict):
        cpus = local_node_cpus()
        if cpus:
            os.sched_setaffinity(0, cpus)  # a node of a local test cluster: this process and its engine keep to its cores
        self.config = ServerConfig.model_validate(config)
        self.usable_cores = len(os.sched_getaffinity(0))
        try:
            self.engine, gpu = start_engine(self.config)
        except StartupError as exc:
            raise RuntimeError(f"selftune replica: {exc}") from None
        self.http_app, self.telemetry, self.controller = build_app(self.engine, self.config, gpu)
        self.identity = registry.replica_identity()
        self._reported = 0.0
        self.telemetry.listeners.append(self._report)
        self.telemetry.start()
        registry.install_routes(self.http_app)
        log.info("replica %s on node %s: %d cores, knobs %s", self.identity["replica"], self.identity["node"], self.usable_cores, self.engine.knobs)

    def __serve_build_asgi_app__(self):
        return self.http_app  # (`app` is taken: Ray's ingress wrapper has a property of that name)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return autoscaling_stats(self.telemetry.latest, self.usable_cores, self.engine.knobs)

    def check_health(self) -> None:
        """Ray Serve calls this; raising makes it replace the replica."""
        stats = self.engine.stats()
        if stats.crash_loop:
            raise RuntimeError(f"engine in a crash loop: {stats.crash_loop}")

    def _report(self, observation: Observation) -> None:
        if observation.time - self._reported < 2.0:
            return  # the registry needs a fresh view every few seconds, not every sample
        self._reported = observation.time
        k = self.engine.knobs
        registry.report(
            {
                **self.identity,
                "cores": self.usable_cores,
                "knobs": dataclasses.asdict(k),  # every knob, the generation ones included
                "policy": self.controller.policy.name if self.controller else None,
                "observed": autoscaling_stats(observation, self.usable_cores, k),
                "reported_at": time.time(),
            }
        )

    def __del__(self):
        telemetry = getattr(self, "telemetry", None)
        if telemetry is not None:
            telemetry.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(grace=0)
