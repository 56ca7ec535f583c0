"""Host-wide CPU, load, memory and context-switch readings from /proc.

The controller decides thread and process counts from how busy the cores are, whether the
hypervisor steals time from them, and how much memory is left for another worker. The readings
are rates since the previous sample, so the monitor keeps the previous counters; the caller
passes `now` (the controller's clock), so nothing here reads a clock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from monitors.topology import read_text

# /proc/stat cpu columns: user nice system idle iowait irq softirq steal guest guest_nice.
# guest and guest_nice are already counted inside user and nice, so they are left out of totals.
_IDLE, _IOWAIT, _STEAL = 3, 4, 7
_COUNTED_COLUMNS = 8


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Raw jiffy counters of one /proc/stat cpu line, kept to compute the next deltas."""

    total: int
    idle: int
    steal: int | None


@dataclass(frozen=True, slots=True)
class CpuUtil:
    """One logical CPU since the previous sample: busy and stolen fractions of its time (0..1).

    busy counts everything but idle and iowait, stolen time included; steal is None where the
    kernel does not report it.
    """

    cpu: int
    busy: float
    steal: float | None


@dataclass(frozen=True, slots=True)
class HostSample:
    """One look at the host. Rate fields are None on the first sample (nothing to compare)."""

    time: float
    cpus: tuple[CpuUtil, ...] | None
    total: CpuUtil | None  # the aggregate "cpu" line; cpu is -1
    load_avg: tuple[float, float, float] | None
    runnable: int | None  # runnable scheduling entities, from /proc/loadavg
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    ctx_switches_per_s: float | None
    cpu_freq_mhz: float | None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StatCounters:
    """What one read of /proc/stat gives: per-CPU times, the aggregate line, ctxt."""

    cpus: dict[int, CpuTimes]
    total: CpuTimes | None
    ctxt: int | None


def parse_stat(text: str) -> StatCounters:
    """Parse /proc/stat into counters."""
    cpus: dict[int, CpuTimes] = {}
    total = None
    ctxt = None
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        head = fields[0]
        if head == "ctxt" and len(fields) > 1:
            ctxt = int(fields[1])
        elif head.startswith("cpu"):
            times = _cpu_times(fields[1:])
            if head == "cpu":
                total = times
            elif head[3:].isdigit():
                cpus[int(head[3:])] = times
    return StatCounters(cpus=cpus, total=total, ctxt=ctxt)


def _cpu_times(values: list[str]) -> CpuTimes:
    nums = [int(v) for v in values[:_COUNTED_COLUMNS]]
    idle = nums[_IDLE] + (nums[_IOWAIT] if len(nums) > _IOWAIT else 0)
    steal = nums[_STEAL] if len(nums) > _STEAL else None
    return CpuTimes(total=sum(nums), idle=idle, steal=steal)


def cpu_util(cpu: int, before: CpuTimes, after: CpuTimes) -> CpuUtil:
    """Busy and steal fractions between two readings of one cpu line (0 when no time passed)."""
    dtotal = after.total - before.total
    if dtotal <= 0:
        return CpuUtil(cpu, 0.0, None if after.steal is None else 0.0)
    busy = 1.0 - (after.idle - before.idle) / dtotal
    steal = None
    if after.steal is not None and before.steal is not None:
        steal = _clamp((after.steal - before.steal) / dtotal)
    return CpuUtil(cpu, _clamp(busy), steal)


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def parse_loadavg(text: str) -> tuple[tuple[float, float, float], int | None]:
    """Parse /proc/loadavg ("1.46 1.50 1.04 3/97 8497") into (averages, runnable)."""
    fields = text.split()
    averages = (float(fields[0]), float(fields[1]), float(fields[2]))
    runnable = int(fields[3].split("/")[0]) if len(fields) > 3 and "/" in fields[3] else None
    return averages, runnable


def parse_meminfo(text: str) -> dict[str, int]:
    """Parse /proc/meminfo ("MemTotal:  24683568 kB") into {field: bytes or count}."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            value = int(parts[1])
        except ValueError:
            continue
        in_kb = len(parts) > 2 and parts[2] == "kB"
        fields[parts[0].rstrip(":")] = value * 1024 if in_kb else value
    return fields


class HostMonitor:
    """Samples /proc under `proc_root`; keeps the previous counters for the rates."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._live = os.path.normpath(proc_root) == "/proc"
        self._prev: StatCounters | None = None
        self._prev_time: float | None = None

    def sample(self, now: float) -> HostSample:
        """Read the host once; `now` is the caller's clock in seconds, used for rates."""
        notes: list[str] = []
        counters = self._read_stat(notes)
        cpus, total, ctx_rate = self._rates(counters, now, notes)
        load, runnable = self._read_loadavg(notes)
        mem = self._read_meminfo(notes)
        if counters is not None:
            self._prev, self._prev_time = counters, now
        return HostSample(
            time=now,
            cpus=cpus,
            total=total,
            load_avg=load,
            runnable=runnable,
            mem_total_bytes=mem.get("MemTotal"),
            mem_available_bytes=mem.get("MemAvailable"),
            ctx_switches_per_s=ctx_rate,
            cpu_freq_mhz=self._cpu_freq(notes),
            notes=tuple(notes),
        )

    def _read_stat(self, notes: list[str]) -> StatCounters | None:
        text = read_text(os.path.join(self.proc_root, "stat"))
        if text is None:
            notes.append(f"{self.proc_root}/stat unreadable")
            return None
        return parse_stat(text)

    def _rates(
        self, counters: StatCounters | None, now: float, notes: list[str]
    ) -> tuple[tuple[CpuUtil, ...] | None, CpuUtil | None, float | None]:
        prev, prev_time = self._prev, self._prev_time
        if counters is None or prev is None or prev_time is None:
            return None, None, None
        elapsed = now - prev_time
        if elapsed <= 0:
            notes.append("no time since the previous sample: rates left out")
            return None, None, None
        cpus = tuple(
            cpu_util(c, prev.cpus[c], t) for c, t in sorted(counters.cpus.items()) if c in prev.cpus
        )
        total = None
        if counters.total is not None and prev.total is not None:
            total = cpu_util(-1, prev.total, counters.total)
        ctx_rate = None
        if counters.ctxt is not None and prev.ctxt is not None:
            ctx_rate = max(0, counters.ctxt - prev.ctxt) / elapsed
        return cpus, total, ctx_rate

    def _read_loadavg(
        self, notes: list[str]
    ) -> tuple[tuple[float, float, float] | None, int | None]:
        text = read_text(os.path.join(self.proc_root, "loadavg"))
        if text is None:
            notes.append(f"{self.proc_root}/loadavg unreadable")
            return None, None
        return parse_loadavg(text)

    def _read_meminfo(self, notes: list[str]) -> dict[str, int]:
        text = read_text(os.path.join(self.proc_root, "meminfo"))
        if text is None:
            notes.append(f"{self.proc_root}/meminfo unreadable")
            return {}
        return parse_meminfo(text)

    def _cpu_freq(self, notes: list[str]) -> float | None:
        if not self._live:
            return None
        try:
            freq = psutil.cpu_freq()
        except (OSError, NotImplementedError, RuntimeError) as e:
            notes.append(f"cpu frequency unavailable: {e}")
            return None
        return float(freq.current) if freq is not None else None
