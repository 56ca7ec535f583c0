"""Placement plans on recorded machines (tests/fixtures/sysfs) and on this one; numa_bind."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from autotune.placement_topology import machine_topology
from engine import numa_bind
from engine.placement import (
    CpuSlot,
    GpuSlot,
    MachineTopology,
    PlacementError,
    format_cpulist,
    plan_placement,
    validate_explicit,
)
from monitors.gpu import GpuMonitor
from monitors.topology import read_topology

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SYSFS = os.path.join(FIXTURES, "sysfs")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_fake_nvml():
    """tests/fixtures is data, not a package: load fake_nvml.py from its path."""
    spec = importlib.util.spec_from_file_location("selftune_fake_nvml_placement",
                                                  os.path.join(FIXTURES, "fake_nvml.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeNvml


def _machine(name: str, allowed: set[int] | None = None) -> MachineTopology:
    return machine_topology(read_topology(os.path.join(SYSFS, name), allowed_cpus=allowed))


def _gpu_machine() -> MachineTopology:
    root = os.path.join(SYSFS, "gpu-8x-2node")
    report = GpuMonitor(nvml=_load_fake_nvml()(), sys_root=root, max_cpus=256).sample(0.0)
    assert len(report.devices) == 8
    return machine_topology(read_topology(root), report.devices)


XEON = _machine("dual-xeon-8168")
DESKTOP = _machine("desktop-8c-smt")
CLOUD = _machine("cloud-2c")


def _core_of(machine: MachineTopology) -> dict[int, tuple[int, int]]:
    return {c.cpu: (c.package, c.core) for c in machine.cpus}


def _node_of(machine: MachineTopology) -> dict[int, int]:
    return {c.cpu: c.node for c in machine.cpus}


def _assert_disjoint(plan) -> None:
    seen: set[int] = set()
    for w in plan.workers:
        assert not seen & set(w.cpus), f"worker {w.worker_index} shares CPUs"
        seen |= set(w.cpus)


def _assert_distinct_cores(machine, plan) -> None:
    core = _core_of(machine)
    for w in plan.workers:
        cores = [core[c] for c in w.cpus]
        assert len(set(cores)) == len(cores), f"worker {w.worker_index} has two SMT siblings"


def _assert_one_node_each(machine, plan) -> None:
    node = _node_of(machine)
    for w in plan.workers:
        assert {node[c] for c in w.cpus} == {w.node}, f"worker {w.worker_index} spans nodes"


# --- the adapter --------------------------------------------------------------------------------

def test_adapter_shapes_of_recorded_machines():
    assert len(XEON.cpus) == 96 and len({(c.package, c.core) for c in XEON.cpus}) == 48
    assert {c.node for c in XEON.cpus} == {0, 1}
    assert len(DESKTOP.cpus) == 16 and len({(c.package, c.core) for c in DESKTOP.cpus}) == 8
    assert [c.cpu for c in CLOUD.cpus] == [0, 1] and XEON.gpus == ()


def test_adapter_keeps_only_allowed_cpus():
    machine = _machine("dual-xeon-8168", allowed={0, 1, 48, 30})
    assert [c.cpu for c in machine.cpus] == [0, 1, 30, 48]
    plan = plan_placement(machine, 2, 1)
    assert {c for w in plan.workers for c in w.cpus} <= {0, 1, 30, 48}


# --- dual Xeon 8168: 2 sockets x 24 cores, SMT, one node per socket ------------------------------

def test_xeon_two_workers_of_24_each_own_a_node_physical_only():
    plan = plan_placement(XEON, 2, 24)
    _assert_disjoint(plan)
    _assert_distinct_cores(XEON, plan)
    _assert_one_node_each(XEON, plan)
    assert [w.node for w in plan.workers] == [0, 1]
    assert [w.cpus for w in plan.workers] == [tuple(range(24)), tuple(range(24, 48))]
    assert plan.notes == ()


def test_xeon_four_workers_of_12_two_per_node():
    plan = plan_placement(XEON, 4, 12)
    _assert_disjoint(plan)
    _assert_distinct_cores(XEON, plan)
    _assert_one_node_each(XEON, plan)
    assert sorted(w.node for w in plan.workers) == [0, 0, 1, 1]
    assert all(len(w.cpus) == 12 for w in plan.workers)
    assert all(c < 48 for w in plan.workers for c in w.cpus)  # no sibling at all
    assert plan.notes == ()


def test_xeon_96_threads_use_siblings_only_after_all_physical_cores():
    plan = plan_placement(XEON, 4, 24)
    _assert_disjoint(plan)
    _assert_distinct_cores(XEON, plan)
    _assert_one_node_each(XEON, plan)
    first_threads = set(range(48))
    # the first two workers take all 48 physical cores; the siblings go to the last two
    assert set(plan.workers[0].cpus) | set(plan.workers[1].cpus) == first_threads
    assert not (set(plan.workers[2].cpus) | set(plan.workers[3].cpus)) & first_threads
    assert sorted(w.node for w in plan.workers) == [0, 0, 1, 1]
    assert any("SMT siblings" in n for n in plan.notes)
    assert not any("oversubscribed" in n for n in plan.notes)


@pytest.mark.parametrize("threads", [1, 8, 12])
def test_xeon_three_workers_balanced_two_one_each_inside_a_node(threads):
    plan = plan_placement(XEON, 3, threads)
    _assert_disjoint(plan)
    _assert_distinct_cores(XEON, plan)
    _assert_one_node_each(XEON, plan)
    assert [w.node for w in plan.workers] == [0, 1, 0]
    assert plan.notes == ()


def test_xeon_physical_cores_win_over_node_locality():
    """3 x 16 = 48 threads fit the 48 physical cores, but not 2 x 16 in one node's 24: the
    third worker spans nodes on physical cores rather than share cores with another worker."""
    plan = plan_placement(XEON, 3, 16)
    _assert_disjoint(plan)
    assert all(c < 48 for w in plan.workers for c in w.cpus)
    assert [w.node for w in plan.workers] == [0, 1, None]
    assert any("worker 2 spans NUMA nodes [0, 1]" in n for n in plan.notes)


def test_xeon_oversubscribed_wraps_and_says_so():
    plan = plan_placement(XEON, 5, 24)
    assert all(len(set(w.cpus)) == 24 for w in plan.workers)
    _assert_one_node_each(XEON, plan)
    assert any("oversubscribed" in n and "120 > 96" in n for n in plan.notes)


def test_xeon_worker_larger_than_all_cpus_gets_them_all():
    plan = plan_placement(XEON, 1, 200)
    assert plan.workers[0].cpus == tuple(range(96))
    assert any("exceeds the 96 allowed CPUs" in n for n in plan.notes)


# --- desktop: 1 socket, 8 cores, 16 threads -----------------------------------------------------

def test_desktop_four_workers_of_two_get_distinct_physical_cores():
    plan = plan_placement(DESKTOP, 4, 2)
    _assert_disjoint(plan)
    core = _core_of(DESKTOP)
    all_cores = [core[c] for w in plan.workers for c in w.cpus]
    assert len(set(all_cores)) == 8  # eight CPUs on eight different physical cores
    assert all(w.node == 0 for w in plan.workers)
    assert plan.notes == ()


def test_desktop_sixteen_single_thread_workers_use_siblings_last():
    plan = plan_placement(DESKTOP, 16, 1)
    _assert_disjoint(plan)
    assert [w.cpus[0] for w in plan.workers[:8]] == list(range(8))  # first threads first
    assert [w.cpus[0] for w in plan.workers[8:]] == list(range(8, 16))  # their siblings last
    assert any("SMT siblings" in n for n in plan.notes)


# --- this kind of VM: 2 vCPUs, one node ----------------------------------------------------------

def test_cloud_two_by_one():
    plan = plan_placement(CLOUD, 2, 1)
    assert [w.cpus for w in plan.workers] == [(0,), (1,)]
    assert [w.node for w in plan.workers] == [0, 0] and plan.notes == ()


def test_cloud_one_by_two():
    plan = plan_placement(CLOUD, 1, 2)
    assert [w.cpus for w in plan.workers] == [(0, 1)] and plan.notes == ()


def test_cloud_two_by_two_is_oversubscribed():
    plan = plan_placement(CLOUD, 2, 2)
    assert [w.cpus for w in plan.workers] == [(0, 1), (0, 1)]
    assert any("oversubscribed" in n for n in plan.notes)
    wide = plan_placement(CLOUD, 1, 3)  # one node: nothing to span, only too few CPUs
    assert wide.workers[0].cpus == (0, 1) and wide.workers[0].node == 0
    assert not any("spans" in n for n in wide.notes)


# --- GPUs: DGX-A100-like, 8 GPUs over 2 nodes ----------------------------------------------------

def test_gpu_eight_workers_one_per_gpu_on_the_gpus_node():
    machine = _gpu_machine()
    assert [g.node for g in machine.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    plan = plan_placement(machine, 8, 8, device="cuda")
    _assert_disjoint(plan)
    _assert_distinct_cores(machine, plan)
    node = _node_of(machine)
    gpu_node = {g.index: g.node for g in machine.gpus}
    assert [w.gpu for w in plan.workers] == list(range(8))
    for w in plan.workers:
        assert {node[c] for c in w.cpus} == {gpu_node[w.gpu]} == {w.node}
    assert plan.notes == ()


def test_gpu_sixteen_workers_two_per_device():
    machine = _gpu_machine()
    plan = plan_placement(machine, 16, 4, device="cuda", workers_per_gpu=2)
    _assert_disjoint(plan)
    assert [w.gpu for w in plan.workers] == [i // 2 for i in range(16)]
    assert all(sum(w.gpu == g for w in plan.workers) == 2 for g in range(8))
    gpu_node = {g.index: g.node for g in machine.gpus}
    assert all(w.node == gpu_node[w.gpu] for w in plan.workers)
    assert plan.notes == ()


def test_gpu_more_workers_than_slots_wraps_with_a_note():
    plan = plan_placement(_gpu_machine(), 9, 4, device="cuda")
    assert plan.workers[8].gpu == 0
    assert any("devices wrap round" in n for n in plan.notes)


def test_gpu_single_device_and_unknown_node():
    machine = MachineTopology(cpus=CLOUD.cpus, gpus=(GpuSlot(0, None), GpuSlot(1, 3)))
    plan = plan_placement(machine, 2, 1, device="cuda")
    assert [(w.gpu, w.cpus) for w in plan.workers] == [(0, (0,)), (1, (1,))]
    assert any("GPU 0" in n for n in plan.notes) and any("GPU 1" in n for n in plan.notes)
    plan = plan_placement(_gpu_machine(), 2, 2, device="cuda:5")
    assert [w.gpu for w in plan.workers] == [5, 5] and {w.node for w in plan.workers} == {1}


def test_cuda_without_known_gpus_falls_back_to_cpu_plan():
    plan = plan_placement(CLOUD, 2, 1, device="cuda")
    assert [w.gpu for w in plan.workers] == [None, None]
    assert [w.cpus for w in plan.workers] == [(0,), (1,)]
    assert any("no such GPU" in n for n in plan.notes)
    assert plan_placement(CLOUD, 2, 1, device="auto") == plan_placement(CLOUD, 2, 1)


# --- modes none and explicit ---------------------------------------------------------------------

def test_none_mode_gives_every_worker_all_cpus():
    plan = plan_placement(XEON, 3, 4, mode="none")
    assert all(w.cpus == tuple(range(96)) and w.node is None for w in plan.workers)
    gpu_plan = plan_placement(_gpu_machine(), 3, 4, mode="none", device="cuda")
    assert [w.gpu for w in gpu_plan.workers] == [0, 1, 2]
    assert all(len(w.cpus) == 256 for w in gpu_plan.workers)


def test_explicit_lists_are_used_as_given():
    plan = plan_placement(XEON, 2, 2, mode="explicit", explicit=((3, 1), (50, 51)))
    assert [w.cpus for w in plan.workers] == [(1, 3), (50, 51)]
    assert [w.node for w in plan.workers] == [0, 0]
    spans = plan_placement(XEON, 1, 2, mode="explicit", explicit=((0, 24),))
    assert spans.workers[0].node is None
    short = plan_placement(XEON, 1, 4, mode="explicit", explicit=((0,),))
    assert any("1 CPU(s) for 4 threads" in n for n in short.notes)


@pytest.mark.parametrize(("explicit", "count", "message"), [
    (((0,), (200,)), 2, "worker 1 lists CPU 200, which is not among the CPUs this process may use (0-95)"),
    (((0, 1), (1, 2)), 2, "CPU 1 is listed for both worker 0 and worker 1"),
    (((0, 0),), 1, "CPU 0 is listed twice"),
    (((0,), (1,)), 3, "2 CPU list(s) but process_count is 3"),
    (((0,), ()), 2, "worker 1 has an empty CPU list"),
    ((("0",),), 1, "worker 0 lists '0', which is not a CPU id"),
])
def test_explicit_validation_errors_are_clear(explicit, count, message):
    with pytest.raises(PlacementError) as info:
        validate_explicit(XEON, explicit, count)
    assert message in str(info.value)
    with pytest.raises(PlacementError, match="explicit placement"):
        plan_placement(XEON, count, 1, mode="explicit", explicit=explicit)


def test_cloud_explicit_outside_allowed_cpus():
    with pytest.raises(PlacementError, match=r"CPU 2, which is not among .*\(0-1\)"):
        validate_explicit(CLOUD, ((2,),))
    validate_explicit(CLOUD, ((0,), (1,)))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "numa"}, "placement mode 'numa'"),
    ({"process_count": 0}, "process_count must be a positive integer"),
    ({"threads_per_process": 0}, "threads_per_process must be a positive integer"),
    ({"workers_per_gpu": 0}, "workers_per_gpu must be a positive integer"),
    ({"device": "tpu"}, "device 'tpu'"),
    ({"mode": "explicit"}, "needs one CPU list per worker"),
])
def test_bad_arguments_raise(kwargs, message):
    args = {"process_count": 1, "threads_per_process": 1} | kwargs
    with pytest.raises(PlacementError, match=message):
        plan_placement(CLOUD, **args)
    with pytest.raises(PlacementError, match="no CPUs"):
        plan_placement(MachineTopology(cpus=()), 1, 1)


# --- determinism and formatting ------------------------------------------------------------------

def test_same_input_same_plan():
    shuffled = MachineTopology(cpus=tuple(reversed(XEON.cpus)))
    for n, t in [(2, 24), (3, 16), (4, 24), (5, 24), (7, 5)]:
        first = plan_placement(XEON, n, t)
        assert plan_placement(XEON, n, t) == first
        assert plan_placement(shuffled, n, t) == first  # input order does not matter
    gpu = _gpu_machine()
    assert plan_placement(gpu, 16, 4, device="cuda", workers_per_gpu=2) == \
        plan_placement(gpu, 16, 4, device="cuda", workers_per_gpu=2)


def test_plan_as_dict_and_cpulist():
    assert format_cpulist([5, 0, 1, 2, 48, 49, 7]) == "0-2,5,7,48-49"
    plan = plan_placement(XEON, 2, 24)
    assert plan.as_dict() == {"workers": [{"worker": 0, "cpus": "0-23", "node": 0, "gpu": None},
                                          {"worker": 1, "cpus": "24-47", "node": 1, "gpu": None}],
                              "notes": []}
    assert plan.describe()[0] == "worker 0: cpus 0-23 node 0"


def test_hand_built_topology_without_smt():
    cpus = tuple(CpuSlot(cpu=i, core=i, package=0, node=i // 4) for i in range(8))
    plan = plan_placement(MachineTopology(cpus), 2, 4)
    assert [w.cpus for w in plan.workers] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [w.node for w in plan.workers] == [0, 1]


# --- this machine ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "t"), [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)])
def test_this_machine_gives_a_valid_plan(n, t):
    topology = read_topology()
    machine = machine_topology(topology)
    allowed = set(topology.allowed)
    assert {c.cpu for c in machine.cpus} == allowed
    plan = plan_placement(machine, n, t)
    assert len(plan.workers) == n
    assert all(w.cpus and set(w.cpus) <= allowed for w in plan.workers)
    if n * t <= len(allowed):
        _assert_disjoint(plan)
        assert all(len(w.cpus) == t for w in plan.workers)
    else:
        assert any("oversubscribed" in note for note in plan.notes)


# --- numa_bind ------------------------------------------------------------------------------------

def _run_child(code: str) -> str:
    """Pinning and memory policy last for the process: try them in a child, not in pytest."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_bind_returns_false_without_libnuma(monkeypatch):
    monkeypatch.setattr(numa_bind, "_libnuma", numa_bind._UNLOADED)
    monkeypatch.setattr(numa_bind.ctypes.util, "find_library", lambda name: None)
    assert numa_bind.bind_memory_to_node(0) is False
    assert numa_bind.bind_memory_to_node(0, strict=True) is False
    assert numa_bind.libnuma_available() is False


def test_bind_returns_false_for_unloadable_libnuma(monkeypatch):
    monkeypatch.setattr(numa_bind, "_libnuma", numa_bind._UNLOADED)
    monkeypatch.setattr(numa_bind.ctypes.util, "find_library", lambda name: "/nonexistent/libnuma.so.1")
    assert numa_bind.bind_memory_to_node(0) is False


def test_bind_rejects_nodes_that_do_not_exist():
    assert numa_bind.bind_memory_to_node(-1) is False
    assert numa_bind.bind_memory_to_node(4096) is False


def test_bind_and_pin_in_a_child():
    """Where libnuma is present (it is on this VM) binding to node 0 works; either way the
    child is pinned to CPU 0 and /proc says so."""
    out = _run_child("""
        import json
        from engine import numa_bind
        has = numa_bind.libnuma_available()
        result = numa_bind.apply_placement([0], 0)
        strict = numa_bind.bind_memory_to_node(0, strict=True)
        status = open('/proc/self/status').read()
        line = [l for l in status.splitlines() if l.startswith('Cpus_allowed_list')][0]
        print(json.dumps([has, result.memory_node, strict, list(result.cpus), line.split()[1]]))
    """)
    has, node, strict, cpus, proc = json.loads(out)
    assert cpus == [0] and proc == "0"
    if has:
        assert (node, strict) == (0, True)
    else:
        assert (node, strict) == (None, False)


def test_pin_rejects_empty_set():
    with pytest.raises(ValueError, match="empty"):
        numa_bind.pin_current_process([])
