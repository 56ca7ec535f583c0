"""The monitors' readers against recorded machines (tests/fixtures) and against this machine."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from monitors.gpu import GpuMonitor, mask_to_cpus, normalize_bus_id
from monitors.host import HostMonitor
from monitors.numa import (
    parse_numa_maps,
    parse_numa_maps_bytes,
    worker_numa_bytes,
    worker_numa_pages,
)
from monitors.procs import ProcessSampler
from monitors.topology import parse_cpulist, parse_node_meminfo, read_topology

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SYSFS = os.path.join(FIXTURES, "sysfs")
PROC = os.path.join(FIXTURES, "proc")


def _load_fake_nvml():
    """tests/fixtures is data, not a package: load fake_nvml.py from its path."""
    path = os.path.join(FIXTURES, "fake_nvml.py")
    spec = importlib.util.spec_from_file_location("selftune_fake_nvml", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeNvml


FakeNvml = _load_fake_nvml()

MONITOR_LOG = "selftune.monitors"


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


# --- cpulists -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-23,48-71", (*range(0, 24), *range(48, 72))),
        ("0", (0,)),
        ("0\n", (0,)),
        ("", ()),
        ("\n", ()),
        ("3,1,2", (1, 2, 3)),
        ("0-3,2-5", (0, 1, 2, 3, 4, 5)),
        ("0-7:2", (0, 2, 4, 6)),
        ("0,8", (0, 8)),
        (" 5-5 ", (5,)),
    ],
)
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["x", "3-1", "1-", "0-7:0"])
def test_parse_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


# --- topology -------------------------------------------------------------------------------


def test_dual_xeon_topology():
    topo = read_topology(os.path.join(SYSFS, "dual-xeon-8168"))
    assert [n.id for n in topo.nodes] == [0, 1]
    assert topo.nodes[0].cpus == (*range(0, 24), *range(48, 72))
    assert topo.nodes[1].cpus == (*range(24, 48), *range(72, 96))
    assert len(topo.cpus) == 96
    assert topo.sockets == 2
    assert topo.physical_cores == 48
    assert topo.smt is True
    assert topo.allowed == frozenset(range(96))  # a recorded tree: every CPU
    cpu0, cpu71, cpu95 = topo.cpus[0], topo.cpus[71], topo.cpus[95]
    assert (cpu0.core_id, cpu0.package_id, cpu0.node, cpu0.siblings) == (0, 0, 0, (0, 48))
    assert (cpu71.core_id, cpu71.package_id, cpu71.node, cpu71.siblings) == (29, 0, 0, (23, 71))
    assert (cpu95.core_id, cpu95.package_id, cpu95.node, cpu95.siblings) == (29, 1, 1, (47, 95))
    # Skylake-SP core ids have gaps: 6, 7, 14, 15, ... never appear.
    assert {c.core_id for c in topo.cpus} == {0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13,
                                              16, 17, 18, 19, 20, 21, 24, 25, 26, 27, 28, 29}
    assert topo.nodes[0].mem_total_bytes == 197448732 * 1024
    assert topo.nodes[0].mem_free_bytes == 160112340 * 1024
    assert topo.nodes[1].mem_total_bytes == 198180864 * 1024
    assert topo.notes == ()


def test_allowed_cpus_argument_wins():
    topo = read_topology(os.path.join(SYSFS, "dual-xeon-8168"), allowed_cpus={0, 48})
    assert topo.allowed == frozenset({0, 48})


def test_desktop_topology():
    topo = read_topology(os.path.join(SYSFS, "desktop-8c-smt"))
    assert len(topo.nodes) == 1
    assert topo.nodes[0].cpus == tuple(range(16))
    assert (topo.sockets, topo.physical_cores, topo.smt) == (1, 8, True)
    assert topo.cpus[0].siblings == (0, 8)
    assert topo.cpus[8].siblings == (0, 8)


def test_cloud_2c_topology_copied_from_this_machine():
    topo = read_topology(os.path.join(SYSFS, "cloud-2c"))
    assert len(topo.nodes) == 1
    assert topo.nodes[0].cpus == (0, 1)
    assert [c.id for c in topo.cpus] == [0, 1]
    assert (topo.sockets, topo.physical_cores, topo.smt) == (1, 2, False)
    assert topo.nodes[0].mem_total_bytes is not None and topo.nodes[0].mem_total_bytes > 0


def test_gpu_machine_topology():
    topo = read_topology(os.path.join(SYSFS, "gpu-8x-2node"))
    assert (topo.sockets, topo.physical_cores, topo.smt, len(topo.cpus)) == (2, 128, True, 256)
    assert topo.nodes[1].cpus == (*range(64, 128), *range(192, 256))


def test_no_node_directory_means_one_node(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(os.path.join(SYSFS, "desktop-8c-smt", "devices", "system", "cpu"),
                    root / "devices" / "system" / "cpu")
    topo = read_topology(str(root))
    assert len(topo.nodes) == 1
    assert topo.nodes[0].cpus == tuple(range(16))
    assert topo.nodes[0].mem_total_bytes is None
    assert all(c.node == 0 for c in topo.cpus)
    assert any("no NUMA nodes" in n for n in topo.notes)


def test_missing_sysfs_is_empty_not_an_error(tmp_path):
    topo = read_topology(str(tmp_path))
    assert topo.cpus == ()
    assert topo.notes


def test_real_topology_of_this_machine():
    topo = read_topology()
    assert len(topo.cpus) == os.cpu_count()
    assert topo.allowed == frozenset(os.sched_getaffinity(0))
    assert topo.sockets >= 1 and topo.physical_cores >= 1
    assert sorted(c for n in topo.nodes for c in n.cpus) == [c.id for c in topo.cpus]


def test_node_meminfo_kernel_format():
    text = "Node 0 MemTotal:        7694056 kB\nNode 0 HugePages_Total:     3\n"
    assert parse_node_meminfo(text) == {"MemTotal": 7694056 * 1024, "HugePages_Total": 3}


# --- numa_maps ------------------------------------------------------------------------------


def test_numa_maps_recorded_worker():
    assert worker_numa_pages(4242, proc_root=PROC) == {0: 108020, 1: 31736}
    # the 2 MiB huge-page mapping (N0=3 N1=1) counts 512 base pages each in bytes
    assert worker_numa_bytes(4242, proc_root=PROC) == {
        0: 108017 * 4096 + 3 * 2 * 1024 * 1024,
        1: 31735 * 4096 + 1 * 2 * 1024 * 1024,
    }


def test_numa_maps_edge_cases():
    assert parse_numa_maps("") == {}
    assert parse_numa_maps("7f3f00000000 default\n") == {}
    assert parse_numa_maps_bytes("1000 default anon=1 N3=2\n") == {3: 8192}  # no page size: 4 KiB


def test_numa_maps_unreadable_is_empty(tmp_path):
    assert worker_numa_pages(4242, proc_root=str(tmp_path)) == {}


def test_numa_maps_of_this_process():
    pages = worker_numa_pages(os.getpid())
    assert set(pages) <= {n.id for n in read_topology().nodes}
    assert sum(pages.values()) > 100  # a Python interpreter maps far more than 100 pages


# --- host -----------------------------------------------------------------------------------


def _copy_proc(src: str, dest) -> None:
    for name in ("stat", "meminfo", "loadavg"):
        shutil.copyfile(os.path.join(PROC, src, name), dest / name)


def test_host_monitor_on_recorded_proc(tmp_path):
    monitor = HostMonitor(proc_root=str(tmp_path))
    _copy_proc("t0", tmp_path)
    first = monitor.sample(100.0)
    assert first.cpus is None and first.total is None and first.ctx_switches_per_s is None
    assert first.load_avg == (0.73, 1.22, 1.04)
    assert first.runnable == 1
    assert first.mem_total_bytes == 24683568 * 1024
    assert first.mem_available_bytes == 24289388 * 1024
    assert first.cpu_freq_mhz is None  # not the live /proc

    _copy_proc("t1", tmp_path)
    second = monitor.sample(102.0)
    got = [(c.cpu, round(c.busy, 9), round(c.steal, 9)) for c in second.cpus]
    assert got == [(0, 0.95, 0.04), (1, 0.3, 0.0), (2, 0.0, 0.0), (3, 0.85, 0.02)]
    assert (round(second.total.busy, 9), round(second.total.steal, 9)) == (0.525, 0.015)
    assert second.ctx_switches_per_s == 25000.0
    assert second.runnable == 2
    assert second.mem_available_bytes == 24289172 * 1024
    assert second.notes == ()


def test_host_monitor_without_proc_files(tmp_path):
    sample = HostMonitor(proc_root=str(tmp_path)).sample(1.0)
    assert sample.cpus is None and sample.load_avg is None and sample.mem_total_bytes is None
    assert len(sample.notes) == 3


def test_host_monitor_on_this_machine():
    monitor = HostMonitor()
    first = monitor.sample(time.monotonic())
    assert first.cpus is None
    _busy(0.3)
    second = monitor.sample(time.monotonic())
    assert len(second.cpus) == os.cpu_count()
    for c in second.cpus:
        assert 0.0 <= c.busy <= 1.0
        assert c.steal is None or 0.0 <= c.steal <= 1.0
    assert max(c.busy for c in second.cpus) > 0.2  # the busy loop ran on some core
    assert second.mem_available_bytes > 0
    assert second.mem_total_bytes >= second.mem_available_bytes
    assert second.ctx_switches_per_s >= 0
    assert second.load_avg is not None


# --- processes ------------------------------------------------------------------------------


def test_process_sampler_busy_child_and_vanished_pid():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 10\nwhile time.time() < end: pass"]
    )
    try:
        sampler = ProcessSampler()
        pids = {0: os.getpid(), 1: child.pid}
        first = sampler.sample(pids, time.monotonic())
        assert set(first) == {0, 1}
        assert first[1].cpu_percent is None  # nothing to compare with yet
        time.sleep(0.5)  # the measurement interval itself
        second = sampler.sample(pids, time.monotonic())
        busy, me = second[1], second[0]
        assert busy.pid == child.pid and busy.worker_id == 1
        assert busy.cpu_percent > 20
        assert busy.rss_bytes > 0 and me.rss_bytes > 0
        assert busy.uss_bytes is None or 0 < busy.uss_bytes <= busy.rss_bytes
        assert me.num_threads >= 1
        assert set(me.cpu_affinity) == os.sched_getaffinity(0)
        assert sum(me.numa_pages.values()) > 0
    finally:
        child.kill()
        child.wait()
    third = sampler.sample(pids, time.monotonic())
    assert set(third) == {0}  # the reaped child is skipped, not an error
    assert child.pid not in sampler._tracked


def test_process_sampler_skips_unreaped_dead_child():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    sampler = ProcessSampler()
    assert set(sampler.sample({1: child.pid}, 0.0)) == {1}
    child.stdin.close()  # the child exits; until wait() it is a zombie
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still unreaped
    assert sampler.sample({1: child.pid}, 1.0) == {}
    child.wait()


def test_process_sampler_skips_unknown_pid():
    pid = 2**22 + 12345  # above the kernel's largest pid_max
    assert ProcessSampler().sample({7: pid}, 1.0) == {}


# --- gpu ------------------------------------------------------------------------------------

A100_BUS_IDS = ("0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0",
                "0000:87:00.0", "0000:90:00.0", "0000:b7:00.0", "0000:bd:00.0")


def _fake_monitor(**kwargs) -> GpuMonitor:
    return GpuMonitor(nvml=FakeNvml(**kwargs), sys_root=os.path.join(SYSFS, "gpu-8x-2node"),
                      max_cpus=256)


def test_gpu_monitor_recorded_a100s():
    report = _fake_monitor().sample(0.0)
    assert report.unavailable_reason is None
    assert len(report.devices) == 8
    assert tuple(d.pci_bus_id for d in report.devices) == A100_BUS_IDS
    assert [d.numa_node for d in report.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    d0 = report.devices[0]
    assert d0.index == 0
    assert d0.name == "NVIDIA A100-SXM4-80GB"
    assert d0.uuid == "GPU-5e3f0c1a-8b2d-4a6e-9f14-2c7d0b8e6a31"
    assert (d0.utilization_gpu, d0.utilization_memory) == (98, 61)
    assert (d0.memory_used_bytes, d0.memory_total_bytes) == (66183479296, 85899345920)
    assert d0.power_watts == pytest.approx(352.147)
    assert (d0.temperature_c, d0.sm_clock_mhz) == (61, 1410)
    assert d0.processes == {48213: 65498251264}
    topo = read_topology(os.path.join(SYSFS, "gpu-8x-2node"))
    for d in report.devices:
        assert d.cpu_affinity == topo.nodes[d.numa_node].cpus


def test_gpu_monitor_field_not_supported_is_none():
    report = _fake_monitor(unsupported=frozenset({"nvmlDeviceGetPowerUsage",
                                                  "nvmlDeviceGetCpuAffinity"})).sample(0.0)
    d7 = report.devices[7]
    assert d7.power_watts is None
    assert d7.cpu_affinity == tuple([*range(64, 128), *range(192, 256)])  # from local_cpulist
    assert d7.temperature_c == 63


def test_gpu_numa_node_absent_from_sysfs_is_none(tmp_path):
    monitor = GpuMonitor(nvml=FakeNvml(), sys_root=str(tmp_path), max_cpus=256)
    report = monitor.sample(0.0)
    assert len(report.devices) == 8
    assert all(d.numa_node is None for d in report.devices)
    assert report.devices[0].cpu_affinity[:2] == (0, 1)  # NVML's mask still gives the CPUs


def test_gpu_monitor_no_driver_logs_once_and_retries_slowly(caplog):
    fake = FakeNvml(no_driver=True)
    monitor = GpuMonitor(nvml=fake, sys_root=os.path.join(SYSFS, "gpu-8x-2node"))
    with caplog.at_level(logging.INFO, logger=MONITOR_LOG):
        reports = [monitor.sample(t) for t in (0.0, 1.0, 30.0, 59.9, 60.0, 200.0)]
    assert all(r.devices == () for r in reports)
    assert all("LibraryNotFound" in r.unavailable_reason for r in reports)
    assert fake.init_calls == 3  # at 0, 60 and 200: at most once a minute
    assert len([r for r in caplog.records if r.name == MONITOR_LOG]) == 1

    fake.no_driver = False  # the driver appears (e.g. after a module load)
    with caplog.at_level(logging.INFO, logger=MONITOR_LOG):
        assert monitor.sample(230.0).devices == ()  # not yet: the last try was at 200
        assert len(monitor.sample(260.0).devices) == 8
    monitor.close()


def test_gpu_monitor_real_nvml_on_this_machine(caplog):
    import pynvml

    try:  # on a machine with a driver, the real readings must come back instead
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_driver = True
    except pynvml.NVMLError:
        has_driver = False
    monitor = GpuMonitor()
    with caplog.at_level(logging.INFO, logger=MONITOR_LOG):
        reports = [monitor.sample(float(t)) for t in range(5)]
    if has_driver:
        assert reports[0].unavailable_reason is None and reports[0].devices
        monitor.close()
        return
    assert all(r.devices == () for r in reports)
    assert all(r.unavailable_reason and "NVML" in r.unavailable_reason for r in reports)
    assert len([r for r in caplog.records if r.name == MONITOR_LOG]) == 1


def test_bus_id_and_mask_helpers():
    assert normalize_bus_id("00000000:B7:00.0") == "0000:b7:00.0"
    assert normalize_bus_id(b"0000:07:00.0") == "0000:07:00.0"
    assert normalize_bus_id(None) is None
    assert mask_to_cpus([0b101, 1]) == (0, 2, 64)
    assert mask_to_cpus([]) == ()
