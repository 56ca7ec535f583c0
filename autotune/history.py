"""What the dashboard draws: a bounded ring of compact points, live or rebuilt from a run's result.

Live, `History.on_observation` listens to the sampler (it reuses the Observation the sampler
already computed, nothing is measured twice) and keeps `capacity` points, one per sampler
interval: about 1 KB each, so the default 900 points (15 minutes at 1 s) hold about 1 MB. The
controller's decisions come from its own bounded audit deque. `offline_points` turns a
simulation or a benchmark run (per-request times and the knob trajectory) into the same
points, so one page shows both (`report_html`).
"""

from __future__ import annotations

import collections
import json
import threading
from importlib.resources import files

import numpy as np

from engine.config import Knobs
from monitors.observation import Observation

STAGES = ("total", "queue", "model", "ttft", "itl")
PAGE = "dashboard.html"


def _round(value, digits: int = 5):
    return None if value is None else round(float(value), digits)


def point(obs: Observation, knobs: Knobs) -> dict:
    """One compact point of an Observation and the knobs in force."""
    load = obs.load
    latency = {}
    for stage in STAGES:
        lat = load.latency.get(stage)
        if lat is not None and lat.count:
            latency[stage] = {"p50": _round(lat.p50), "p95": _round(lat.p95), "p99": _round(lat.p99)}
    workers = [
        {"id": w.worker_id, "state": w.state, "cpu": _round(w.cpu_percent, 1), "rss": w.rss_bytes, "uss": w.uss_bytes,
         "busy": _round(w.busy_fraction, 3), "load": w.load, "batch": _round(w.batch_size, 2), "cpus": list(w.cpus), "numa": sorted(w.numa_pages)}
        for w in obs.workers
    ]
    gpus = [{"index": g.index, "name": g.name, "util": g.utilization_gpu, "mem_used": g.memory_used_bytes,
             "mem_total": g.memory_total_bytes, "power": g.power_watts} for g in (obs.gpu.devices if obs.gpu else ())]
    host = obs.host
    return {
        "t": round(obs.time, 3),
        "arrival_rate": _round(load.arrival_rate, 3),
        "completion_rate": _round(load.completion_rate, 3),
        "rejected_rate": _round(load.rejected_rate, 3),
        "timed_out_rate": _round(load.timed_out_rate, 3),
        "queue_depth": load.queue_depth,
        "batch_size": _round(load.batch_size, 2),
        "tokens_per_second": _round(load.tokens_per_second, 2),
        "busy": _round(obs.busy_fraction, 3),
        "host_cpu": _round(host.total.busy, 3) if host is not None and host.total is not None else None,
        "latency": latency,
        "knobs": knobs.as_dict(),
        "workers": workers,
        "gpus": gpus,
    }


class History:
    """The live ring buffer behind GET /stats/history; safe to read while the sampler writes."""

    def __init__(self, knobs_of, capacity: int = 900):
        self.knobs_of = knobs_of
        """() -> the Knobs in force (the engine's)."""
        self._points: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._points.maxlen

    def on_observation(self, obs: Observation) -> None:
        entry = point(obs, self.knobs_of())
        with self._lock:
            self._points.append(entry)

    def points(self, seconds: float) -> list[dict]:
        with self._lock:
            if not self._points:
                return []
            since = self._points[-1]["t"] - seconds
            return [p for p in self._points if p["t"] >= since]


def offline_points(arrival: np.ndarray, done: np.ndarray, ok: np.ndarray, knob_changes: list[tuple[float, Knobs]],
                   end: float, step: float | None = None) -> list[dict]:
    """Points of a finished run, one per `step` seconds (default: 1 s, or 600 points over a long
    run): rates of arrivals, completions and rejections, latency percentiles of the requests
    that finished in it, the knobs in force at its end."""
    step = step or max(1.0, end / 600)
    bins = max(1, int(np.ceil(end / step)))
    edges = np.arange(bins + 1) * step
    latency = done - arrival
    finished = np.clip(np.searchsorted(edges, done[ok], side="right") - 1, 0, bins - 1)
    arrived = np.histogram(arrival, edges)[0]
    rejected = np.histogram(arrival[~ok], edges)[0]
    completed = np.bincount(finished, minlength=bins)
    by_bin = np.split(latency[ok][np.argsort(finished, kind="stable")], np.cumsum(completed)[:-1])
    times = [t for t, _ in knob_changes]
    points = []
    for b in range(bins):
        values = by_bin[b]
        knobs = knob_changes[max(0, int(np.searchsorted(times, edges[b + 1], side="right")) - 1)][1]
        p50, p95, p99 = np.percentile(values, (50, 95, 99)) if len(values) else (None, None, None)
        points.append({
            "t": round(float(edges[b + 1]), 3),
            "arrival_rate": round(arrived[b] / step, 3),
            "completion_rate": round(completed[b] / step, 3),
            "rejected_rate": round(rejected[b] / step, 3),
            "latency": {"total": {"p50": _round(p50), "p95": _round(p95), "p99": _round(p99)}} if len(values) else {},
            "knobs": knobs.as_dict(),
        })
    return points


def page() -> str:
    return (files("autotune") / PAGE).read_text(encoding="utf-8")


def report_html(data: dict) -> str:
    """The dashboard page with a run's data inside it: one file that opens anywhere, offline."""
    text = json.dumps(data, separators=(",", ":"), default=str).replace("</", "<\\/")  # no early </script>
    return page().replace('<script id="data" type="application/json">null</script>',
                          f'<script id="data" type="application/json">{text}</script>', 1)


def write_report(path: str, info: dict, arrival: np.ndarray, done: np.ndarray, ok: np.ndarray,
                 knob_changes: list[tuple[float, Knobs]], end: float, decisions: list[dict]) -> None:
    """A finished run (simulated or benchmarked) as the dashboard page, in one HTML file."""
    points = offline_points(arrival, done, ok, knob_changes, end)
    with open(path, "w", encoding="utf-8") as f:
        f.write(report_html({"info": {"mode": "report", **info}, "points": points, "decisions": decisions}))
