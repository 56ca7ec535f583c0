"""GPU readings through NVML: utilisation, memory, power, temperature, clocks, processes.

The controller needs to know whether a GPU is saturated before adding a worker to it, and
placement needs each GPU's NUMA node so a worker's CPU threads sit next to its device. The NVML
module is an argument (the real `pynvml` by default) so tests can hand in recorded readings.
Without a driver (this machine: NVMLError_LibraryNotFound) the report is empty with the reason,
logged once, never raised; init is retried at most every `retry_interval_s`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from monitors.topology import parse_cpulist

log = logging.getLogger("selftune.monitors")

_WORD_BITS = 64


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One device at one moment. Fields NVML could not give (not supported, no permission) are
    None. pci_bus_id is in the kernel's form ("0000:07:00.0"), so it names the sysfs device."""

    index: int
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    utilization_gpu: int | None  # percent of time a kernel ran, last sample period
    utilization_memory: int | None  # percent of time device memory was read or written
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_watts: float | None
    temperature_c: int | None
    sm_clock_mhz: int | None
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> used bytes
    numa_node: int | None = None
    cpu_affinity: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class GpuReport:
    """All devices; empty with `unavailable_reason` set when NVML cannot be used."""

    devices: tuple[GpuSample, ...]
    unavailable_reason: str | None


def normalize_bus_id(bus_id: str | bytes | None) -> str | None:
    """NVML's "00000000:B7:00.0" -> the kernel's "0000:b7:00.0"."""
    if bus_id is None:
        return None
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text or None
    return f"{int(domain, 16):04x}:{rest}" if domain else rest


def mask_to_cpus(words) -> tuple[int, ...]:
    """NVML's CPU affinity (an array of 64-bit words, CPU 0 = bit 0 of word 0) -> CPU ids."""
    cpus = []
    for w, word in enumerate(words):
        word = int(word)
        for bit in range(_WORD_BITS):
            if word >> bit & 1:
                cpus.append(w * _WORD_BITS + bit)
    return tuple(cpus)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_sys(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


class GpuMonitor:
    """Samples every NVML device. Not thread-safe: one controller loop owns it."""

    def __init__(
        self,
        nvml: ModuleType | Any | None = None,
        sys_root: str = "/sys",
        retry_interval_s: float = 60.0,
        max_cpus: int | None = None,
    ) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        self.sys_root = sys_root
        self.retry_interval_s = retry_interval_s
        self._cpu_words = max(1, -(-(max_cpus or os.cpu_count() or 1) // _WORD_BITS))
        self._errors = _error_types(nvml)
        self._initialised = False
        self._reason: str | None = None
        self._last_attempt: float | None = None
        self._logged_reason: str | None = None

    def sample(self, now: float) -> GpuReport:
        """Read all devices; `now` (caller's clock, seconds) paces init retries."""
        if not self._ensure_init(now):
            return GpuReport((), self._reason)
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except self._errors as e:
            return GpuReport((), f"nvmlDeviceGetCount failed: {_describe(e)}")
        devices = tuple(self._device(i) for i in range(count))
        return GpuReport(devices, None)

    def close(self) -> None:
        """Shut NVML down if this monitor initialised it."""
        if self._initialised:
            self._initialised = False
            self._call(self.nvml.nvmlShutdown)

    def _ensure_init(self, now: float) -> bool:
        if self._initialised:
            return True
        if self._last_attempt is not None and now - self._last_attempt < self.retry_interval_s:
            return False
        self._last_attempt = now
        try:
            self.nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - any init failure means "no GPU readings"
            self._reason = f"NVML unavailable: {_describe(e)}"
            if self._reason != self._logged_reason:
                log.info("GPU monitoring off: %s", self._reason)
                self._logged_reason = self._reason
            return False
        if self._logged_reason is not None:
            log.info("NVML initialised after earlier failure")
        self._initialised, self._reason, self._logged_reason = True, None, None
        return True

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors:
            return None

    def _device(self, index: int) -> GpuSample:
        nv = self.nvml
        handle = self._call(nv.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return GpuSample(index, None, None, None, None, None, None, None, None, None, None)
        pci = self._call(nv.nvmlDeviceGetPciInfo, handle)
        bus_id = normalize_bus_id(getattr(pci, "busId", None)) if pci is not None else None
        util = self._call(nv.nvmlDeviceGetUtilizationRates, handle)
        mem = self._call(nv.nvmlDeviceGetMemoryInfo, handle)
        power_mw = self._call(nv.nvmlDeviceGetPowerUsage, handle)
        return GpuSample(
            index=index,
            name=_text(self._call(nv.nvmlDeviceGetName, handle)),
            uuid=_text(self._call(nv.nvmlDeviceGetUUID, handle)),
            pci_bus_id=bus_id,
            utilization_gpu=getattr(util, "gpu", None),
            utilization_memory=getattr(util, "memory", None),
            memory_used_bytes=getattr(mem, "used", None),
            memory_total_bytes=getattr(mem, "total", None),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            temperature_c=self._call(
                nv.nvmlDeviceGetTemperature, handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0)
            ),
            sm_clock_mhz=self._call(
                nv.nvmlDeviceGetClockInfo, handle, getattr(nv, "NVML_CLOCK_SM", 1)
            ),
            processes=self._processes(handle),
            numa_node=self._numa_node(handle, bus_id),
            cpu_affinity=self._cpu_affinity(handle, bus_id),
        )

    def _processes(self, handle: Any) -> dict[int, int | None]:
        procs = self._call(self.nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        return {int(p.pid): getattr(p, "usedGpuMemory", None) for p in procs}

    def _pci_file(self, bus_id: str, name: str) -> str | None:
        return _read_sys(os.path.join(self.sys_root, "bus", "pci", "devices", bus_id, name))

    def _numa_node(self, handle: Any, bus_id: str | None) -> int | None:
        if bus_id is not None:
            text = self._pci_file(bus_id, "numa_node")
            if text is not None and text.lstrip("-").isdigit():
                return int(text) if int(text) >= 0 else None  # -1: the platform gives no node
        getter = getattr(self.nvml, "nvmlDeviceGetNumaNodeId", None)
        node = self._call(getter, handle) if getter is not None else None
        return node if isinstance(node, int) and node >= 0 else None

    def _cpu_affinity(self, handle: Any, bus_id: str | None) -> tuple[int, ...] | None:
        getter = getattr(self.nvml, "nvmlDeviceGetCpuAffinity", None)
        words = self._call(getter, handle, self._cpu_words) if getter is not None else None
        if words is not None:
            cpus = mask_to_cpus(words)
            if cpus:
                return cpus
        if bus_id is not None:
            text = self._pci_file(bus_id, "local_cpulist")
            if text:
                return parse_cpulist(text)
        return None


def _error_types(nvml: Any) -> tuple[type[BaseException], ...]:
    types = [getattr(nvml, name, None) for name in ("NVMLError", "NVMLLibraryMismatchError")]
    found = tuple(t for t in types if isinstance(t, type) and issubclass(t, BaseException))
    return found or (Exception,)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
