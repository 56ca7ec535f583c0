"""An in-process engine held at saturation: N requests always in flight, throughput, CPU per process and per front thread (the benchmark scripts' shared measurement)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Callable

import psutil

from autotune.bench.machine import LoadMonitor

TARGET_TOKENS = 16
"""The scripts' single-text requests: sentences of this many tokens."""


def engine_procs(eng):
    pids = eng.pids
    procs = {"front": psutil.Process(os.getpid())}
    for pid in pids["zygote"]:
        procs["zygote"] = psutil.Process(pid)
    for i, pid in enumerate(pids["workers"]):
        procs[f"worker{i}"] = psutil.Process(pid)
    return procs


def cpu_times(procs) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            t = p.cpu_times()
            out[name] = t.user + t.system
        except Exception:
            out[name] = float("nan")
    return out


def front_thread_cpu() -> dict[str, float]:
    """CPU seconds per front-process thread, by thread name (from /proc)."""
    names = {}
    for t in threading.enumerate():
        if t.native_id is not None:
            names[t.native_id] = t.name
    out = {}
    for th in psutil.Process().threads():
        name = names.get(th.id, f"native-{th.id}")
        out[name] = out.get(name, 0.0) + th.user_time + th.system_time
    return out


class _Feeder:
    """Keeps `outstanding` single-text requests in flight from a thread; logs each completion."""

    def __init__(self, eng, texts, outstanding: int):
        self.eng, self.texts = eng, texts
        self.sem = threading.Semaphore(outstanding)
        self.stop = threading.Event()
        self.done_log: list = []
        self.errors: list = []
        self.thread = threading.Thread(target=self._feed, name="bench-feeder", daemon=True)
        self.thread.start()

    def _on_done(self, f) -> None:
        self.sem.release()
        exc = f.exception()
        if exc is not None:
            self.errors.append(exc)
        else:
            self.done_log.append((time.monotonic(), f.result().timings))

    def _feed(self) -> None:
        i = 0
        while not self.stop.is_set():
            if not self.sem.acquire(timeout=0.1):
                continue
            self.eng.embed(self.texts[i % len(self.texts)]).add_done_callback(self._on_done)
            i += 1

    def finish(self) -> None:
        """Stop sending and wait (up to a minute) for what is in flight."""
        self.stop.set()
        self.thread.join()
        deadline = time.monotonic() + 60
        while self.eng.stats().pending_requests and time.monotonic() < deadline:
            time.sleep(0.05)


def saturate(eng, texts, outstanding: int, warmup: float, duration: float, label: str, mon: LoadMonitor, log: Callable[[str], None]) -> dict:
    """Keep `outstanding` single-text requests in flight; completed/s over `duration` after `warmup`."""
    feeder = _Feeder(eng, texts, outstanding)
    time.sleep(warmup)
    procs = engine_procs(eng)
    s0, c0, th0, t0 = eng.stats(), cpu_times(procs), front_thread_cpu(), time.monotonic()
    n0 = len(feeder.done_log)
    next_print = t0 + 2.0
    while (now := time.monotonic()) < t0 + duration:
        time.sleep(min(0.25, t0 + duration - now))
        if time.monotonic() >= next_print:
            next_print += 2.0
            rate = (len(feeder.done_log) - n0) / (time.monotonic() - t0)
            log(f"  {label}: {rate:7.1f} req/s so far")
    s1, c1, th1, t1 = eng.stats(), cpu_times(procs), front_thread_cpu(), time.monotonic()
    n1 = len(feeder.done_log)
    feeder.finish()
    wall = t1 - t0
    window = [tm for (ts, tm) in feeder.done_log[n0:n1]]
    k0, k1 = s0.counters, s1.counters
    busy0 = {w.worker_id: w.busy_seconds for w in s0.workers}
    busy = {w.worker_id: (w.busy_seconds - busy0.get(w.worker_id, 0.0)) / wall for w in s1.workers}

    def mean(attr):
        return statistics.fmean(getattr(t, attr) for t in window) * 1e3 if window else float("nan")

    batches = k1.batches - k0.batches
    return {
        "label": label,
        "knobs": eng.knobs.as_dict(),
        "outstanding": outstanding,
        "seconds": wall,
        "completed": k1.completed - k0.completed,
        "throughput": (k1.completed - k0.completed) / wall,
        "mean_batch": (k1.items - k0.items) / batches if batches else 0.0,
        "worker_model_busy": busy,
        "cpu_share": {name: (c1[name] - c0[name]) / wall for name in c0},
        "front_threads_cpu": {name: (th1.get(name, 0.0) - th0.get(name, 0.0)) / wall for name in th1},
        "timings_ms": {a: mean(a) for a in ("preprocess", "queue", "model", "total")},
        "errors": len(feeder.errors),
        "other_load_cores": mon.foreign(t0, t1),
    }
