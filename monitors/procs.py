"""Per-worker process readings: CPU use, memory, threads, affinity, NUMA pages.

The controller compares workers with each other (is one starved, is one swapping its pages to
the wrong node) and counts the real memory cost of one more worker (USS: forked workers share
the zygote's pages, so RSS overstates it). psutil.Process objects are cached per pid so each
sample costs a few /proc reads per worker; pids that disappear are dropped, never an error.

USS (smaps_rollup) and NUMA pages (numa_maps) make the kernel walk the process's page
tables: ~10 ms each for a worker holding torch. They change slowly, so they are re-read at
most every `detail_seconds` per worker and carried over in between; CPU, RSS, threads and
affinity are read every sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from monitors.numa import worker_numa_pages


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One worker process since the previous sample.

    cpu_percent is 100 per fully busy core and None the first time a pid is seen; uss_bytes is
    None where reading it needs privileges we lack.
    """

    worker_id: int
    pid: int
    cpu_percent: float | None
    rss_bytes: int
    uss_bytes: int | None
    num_threads: int
    cpu_affinity: tuple[int, ...] | None
    numa_pages: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Tracked:
    process: psutil.Process
    cpu_seconds: float
    time: float
    uss: int | None = None
    numa: dict[int, int] = field(default_factory=dict)
    detail_time: float | None = None


_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess)


class ProcessSampler:
    """Samples worker processes; keeps their psutil objects and last CPU times between calls."""

    def __init__(self, proc_root: str = "/proc", read_numa: bool = True, detail_seconds: float = 30.0) -> None:
        self.proc_root = proc_root
        self.read_numa = read_numa
        self.detail_seconds = detail_seconds
        self._tracked: dict[int, _Tracked] = {}

    def sample(self, pids: dict[int, int], now: float) -> dict[int, ProcSample]:
        """Read each worker (worker_id -> pid) at `now` (caller's clock, seconds)."""
        out: dict[int, ProcSample] = {}
        for worker_id, pid in pids.items():
            reading = self._sample_one(worker_id, pid, now)
            if reading is not None:
                out[worker_id] = reading
        live = set(pids.values())
        for pid in [p for p in self._tracked if p not in live]:
            del self._tracked[pid]
        return out

    def _sample_one(self, worker_id: int, pid: int, now: float) -> ProcSample | None:
        try:
            tracked = self._tracked.get(pid)
            if tracked is not None and not tracked.process.is_running():  # pid was reused
                tracked = None
            process = tracked.process if tracked else psutil.Process(pid)
            detail_due = tracked is None or tracked.detail_time is None or now - tracked.detail_time >= self.detail_seconds
            with process.oneshot():
                if process.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped
                    raise psutil.ZombieProcess(pid)
                times = process.cpu_times()
                cpu_seconds = times.user + times.system
                rss, uss = _memory(process) if detail_due else (process.memory_info().rss, tracked.uss)
                threads = process.num_threads()
                affinity = _affinity(process)
        except _GONE:
            self._tracked.pop(pid, None)
            return None
        except psutil.AccessDenied:
            return None
        cpu_percent = None
        if tracked is not None and now > tracked.time:
            cpu_percent = max(0.0, cpu_seconds - tracked.cpu_seconds) / (now - tracked.time) * 100
        if detail_due:
            numa = worker_numa_pages(pid, self.proc_root) if self.read_numa else {}
            self._tracked[pid] = _Tracked(process, cpu_seconds, now, uss, numa, now)
        else:
            numa = tracked.numa
            self._tracked[pid] = _Tracked(process, cpu_seconds, now, uss, numa, tracked.detail_time)
        return ProcSample(worker_id, pid, cpu_percent, rss, uss, threads, affinity, numa)


def _memory(process: psutil.Process) -> tuple[int, int | None]:
    try:
        full = process.memory_full_info()
        return full.rss, getattr(full, "uss", None)
    except psutil.AccessDenied:  # USS reads smaps, which may need privileges
        return process.memory_info().rss, None


def _affinity(process: psutil.Process) -> tuple[int, ...] | None:
    try:
        return tuple(process.cpu_affinity())
    except (psutil.AccessDenied, AttributeError, NotImplementedError):
        return None
