"""The sampler: turns cumulative engine readings and host readers into Observations.

`sample(now)` is called every interval (1 s by default) by a thread at the edge (the
composition root); `now` comes in, so the simulator can drive the same code. The engine is
read through `EngineReading`, a plain bundle the caller fills, so monitors never import the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from monitors.gpu import GpuMonitor
from monitors.host import HostMonitor
from monitors.observation import BatchTimes, Latency, Load, Observation, WorkerObservation
from monitors.procs import ProcessSampler
from monitors.topology import read_topology
from monitors.window import SnapshotWindow, percentile

BATCH_TIME_COUNTERS = ("batches_done", "model_seconds", "items_done", "items_done_squared", "item_model_seconds")
"""The finished batches' sums behind Load.batch_seconds and Load.batch_times."""
COUNTERS = (
    "requests",
    "completed",
    "failed",
    "rejected",
    "shed",
    "timed_out",
    "batches",
    "items",
    "real_tokens",
    "padded_tokens",
    "generated_tokens",
    *BATCH_TIME_COUNTERS,
)


def batch_figures(change: dict) -> dict:
    """Load's per-batch figures from counter changes over a window (the simulator's sampler uses it too)."""
    return {
        "batch_size": change["items"] / change["batches"] if change["batches"] else 0.0,
        "batch_fill": change["real_tokens"] / change["padded_tokens"] if change["padded_tokens"] else 1.0,
        "batch_seconds": change["model_seconds"] / change["batches_done"] if change["batches_done"] else 0.0,
        "batch_times": BatchTimes(
            batches=int(change["batches_done"]),
            items=float(change["items_done"]),
            items_squared=float(change["items_done_squared"]),
            seconds=float(change["model_seconds"]),
            item_seconds=float(change["item_model_seconds"]),
        ),
    }


class LoadWindow:
    """Load over the last window from cumulative counter totals (the live sampler and the
    simulator's build it here, so rates, batch figures and queue fields mean the same)."""

    def __init__(self, window_seconds: float):
        self._totals = SnapshotWindow(window_seconds)

    def load(self, now: float, totals: Mapping[str, float], queue_depth: int, queue_wait: float, pending_requests: int, latency: dict[str, Latency]) -> Load:
        """`totals` has every name in COUNTERS (cumulative since the start)."""
        self._totals.push(now, np.array([totals[n] for n in COUNTERS], dtype=np.float64))
        common = dict(queue_depth=queue_depth, queue_wait=queue_wait, pending_requests=pending_requests, latency=latency)
        delta = self._totals.delta()
        if delta is None:
            return Load(**common)
        elapsed, d = delta
        rate = dict(zip(COUNTERS, d / elapsed))
        return Load(
            arrival_rate=rate["requests"],
            completion_rate=rate["completed"],
            rejected_rate=rate["rejected"],
            shed_rate=rate["shed"],
            timed_out_rate=rate["timed_out"],
            failed_rate=rate["failed"],
            items_rate=rate["items"],
            input_tokens_per_second=rate["real_tokens"],
            tokens_per_second=rate["generated_tokens"],
            **batch_figures(dict(zip(COUNTERS, d))),
            **common,
        )


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One cumulative reading of the engine (and the HTTP layer in front of it).

    `stats` needs: counters (requests, completed, failed, batches, items, real_tokens,
    padded_tokens, generated_tokens and BATCH_TIME_COUNTERS), queue_depth, oldest_wait_seconds, pending_requests,
    and workers with worker_id, pid, state, load, busy_seconds (generation workers also
    running_sequences, waiting_sequences, kv_tokens_used, kv_tokens_total, preemptions). `latency` maps a stage to
    (cumulative bucket counts, sum of seconds) over the buckets `upper_bounds`.
    """

    stats: Any
    latency: dict[str, tuple[np.ndarray, float]]
    upper_bounds: np.ndarray
    rejected: int = 0
    timed_out: int = 0


class Sampler:
    def __init__(
        self,
        read_engine: Callable[[], EngineReading],
        window_seconds: float = 10.0,
        host: HostMonitor | None = None,
        procs: ProcessSampler | None = None,
        gpu: GpuMonitor | None = None,
        sys_root: str = "/sys",
    ):
        self.read_engine = read_engine
        self.window_seconds = window_seconds
        self.host = host if host is not None else HostMonitor()
        self.procs = procs if procs is not None else ProcessSampler()
        self.gpu = gpu if gpu is not None else GpuMonitor()
        self.sys_root = sys_root
        self._load_window = LoadWindow(window_seconds)
        self._latency: dict[str, SnapshotWindow] = {}
        self._busy: dict[int, SnapshotWindow] = {}

    def sample(self, now: float) -> Observation:
        reading = self.read_engine()
        load = self._load(now, reading)
        workers = self._workers(now, reading.stats.workers)
        topology = read_topology(self.sys_root)
        return Observation(
            time=now,
            window_seconds=self.window_seconds,
            load=load,
            workers=workers,
            host=self.host.sample(now),
            numa=topology.nodes,
            gpu=self.gpu.sample(now),
        )

    def _load(self, now: float, reading: EngineReading) -> Load:
        stats = reading.stats
        extra = {"rejected": reading.rejected, "timed_out": reading.timed_out}
        totals = {n: extra[n] if n in extra else getattr(stats.counters, n) for n in COUNTERS}
        latency = {
            stage: self._latency_window(now, stage, counts, total, reading.upper_bounds)
            for stage, (counts, total) in reading.latency.items()
        }
        latency = {stage: summary for stage, summary in latency.items() if summary.count}
        return self._load_window.load(now, totals, stats.queue_depth, stats.oldest_wait_seconds, stats.pending_requests, latency)

    def _latency_window(self, now: float, stage: str, counts: np.ndarray, total: float, bounds: np.ndarray) -> Latency:
        window = self._latency.setdefault(stage, SnapshotWindow(self.window_seconds))
        window.push(now, np.append(counts, total))
        delta = window.delta()
        if delta is None:
            return Latency()
        _, d = delta
        buckets, seconds = d[:-1], d[-1]
        count = int(buckets.sum())
        if count == 0:
            return Latency()
        return Latency(
            p50=percentile(buckets, bounds, 0.50),
            p95=percentile(buckets, bounds, 0.95),
            p99=percentile(buckets, bounds, 0.99),
            mean=seconds / count,
            count=count,
        )

    def _workers(self, now: float, workers) -> tuple[WorkerObservation, ...]:
        live = {w.worker_id for w in workers}
        for gone in set(self._busy) - live:
            del self._busy[gone]
        procs = self.procs.sample({w.worker_id: w.pid for w in workers if w.pid is not None}, now)
        out = []
        for w in workers:
            window = self._busy.setdefault(w.worker_id, SnapshotWindow(self.window_seconds))
            window.push(now, np.array((w.busy_seconds, w.batches, w.items, getattr(w, "preemptions", 0)), dtype=float))
            delta = window.delta()
            busy = min(1.0, max(0.0, delta[1][0] / delta[0])) if delta else 0.0
            batch_size = delta[1][2] / delta[1][1] if delta and delta[1][1] > 0 else 0.0
            proc = procs.get(w.worker_id)
            out.append(
                WorkerObservation(
                    worker_id=w.worker_id,
                    pid=w.pid,
                    state=w.state,
                    busy_fraction=busy,
                    load=w.load,
                    batch_size=batch_size,
                    cpu_percent=proc.cpu_percent if proc else None,
                    rss_bytes=proc.rss_bytes if proc else None,
                    uss_bytes=proc.uss_bytes if proc else None,
                    threads=proc.num_threads if proc else None,
                    cpus=tuple(proc.cpu_affinity or ()) if proc else (),
                    numa_pages=dict(proc.numa_pages) if proc else {},
                    **_generation_figures(w, delta),
                )
            )
        return tuple(out)


def _generation_figures(w, delta) -> dict:
    """A generation worker's sequences and KV figures (absent from embedding workers: zeros)."""
    return {
        "running_sequences": getattr(w, "running_sequences", 0),
        "waiting_sequences": getattr(w, "waiting_sequences", 0),
        "kv_tokens_used": getattr(w, "kv_tokens_used", 0),
        "kv_tokens_total": getattr(w, "kv_tokens_total", 0),
        "preemptions": int(delta[1][3]) if delta else 0,
    }
