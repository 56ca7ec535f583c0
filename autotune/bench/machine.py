"""What machine a benchmark ran on, and how busy other processes kept it."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import threading
import time
from typing import Callable


def machine_info() -> dict:
    import importlib.metadata as md

    import psutil

    cpu = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
                break
    except Exception:
        pass

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "kernel": platform.release(),
    }


class LoadMonitor:
    """Samples, every `interval` s, how many cores processes outside this benchmark's tree use.

    Busy CPU of the whole machine (/proc/stat) minus the CPU of this process and all its
    descendants; `foreign(t0, t1)` is the mean over a window. Other people's tests on a shared
    machine show up here, and the benchmark waits for quiet before each measurement.
    """

    def __init__(self, interval: float = 0.5, say: Callable[[str], None] = lambda msg: None):
        self._say = say
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (time, foreign cores over the last interval)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-loadmon", daemon=True)
        self._thread.start()

    def _ours(self) -> dict[int, float]:
        me = self._psutil.Process()
        out = {}
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system + t.children_user + t.children_system
            except self._psutil.Error:
                pass
        return out

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)

    def _run(self) -> None:
        prev_t, prev_busy, prev_ours = time.monotonic(), self._busy(), self._ours()
        while not self._stop.wait(self.interval):
            now, busy, ours = time.monotonic(), self._busy(), self._ours()
            mine = sum(max(0.0, v - prev_ours[pid]) for pid, v in ours.items() if pid in prev_ours)
            mine += sum(v for pid, v in ours.items() if pid not in prev_ours)
            foreign = max(0.0, (busy - prev_busy) - mine) / (now - prev_t)
            self.samples.append((now, foreign))
            prev_t, prev_busy, prev_ours = now, busy, ours

    def foreign(self, t0: float, t1: float) -> float:
        window = [f for (t, f) in self.samples if t0 < t <= t1 + self.interval / 2]
        return statistics.fmean(window) if window else float("nan")

    def wait_quiet(self, threshold: float = 0.15, quiet_for: float = 2.0, max_wait: float = 60.0) -> float:
        """Wait until others use < `threshold` cores for `quiet_for` s; returns seconds waited."""
        started = time.monotonic()
        warned = False
        while time.monotonic() - started < max_wait:
            now = time.monotonic()
            recent = [f for (t, f) in self.samples if t > now - quiet_for]
            if len(recent) >= max(1, int(quiet_for / self.interval) - 1) and max(recent) < threshold:
                return now - started
            if not warned and now - started > 1.0:
                self._say(f"  waiting for other processes to go quiet (now {recent[-1] if recent else float('nan'):.2f} cores busy)")
                warned = True
            time.sleep(self.interval)
        self._say(f"  machine still busy after {max_wait:.0f}s; measuring anyway (see the 'other load' column)")
        return time.monotonic() - started

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
