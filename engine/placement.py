"""Placement: which CPUs, NUMA node and GPU each worker gets. A pure function of its inputs.

Several inference processes on one machine are only fast when each owns its cores (no two
workers' torch thread pools fight over a core), uses physical cores before SMT siblings (two
threads on one core share its FPUs and caches), and keeps its memory on its own NUMA node (a
remote node costs latency and bandwidth on every forward pass). This is what PyTorch's
`torch.backends.xeon.run_cpu` launcher does with numactl; selftune does it itself, and again
every time the controller changes the worker count.

The engine may not import the monitors, so the planner takes its own small input types
(`MachineTopology`); autotune/placement_topology.py builds them from what the monitors read.
Same input, same plan: nothing here depends on dict or set iteration order, clocks or the
machine it runs on.
"""

from __future__ import annotations

from collections import defaultdict
import os
from dataclasses import dataclass
from typing import Literal

PlacementMode = Literal["auto", "none", "explicit"]
MODES: tuple[PlacementMode, ...] = ("auto", "none", "explicit")


class PlacementError(ValueError):
    """A placement that cannot be made (bad arguments, invalid explicit CPU lists)."""


@dataclass(frozen=True, slots=True)
class CpuSlot:
    """One logical CPU. `core` is unique within its package: (package, core) names a physical
    core, so SMT siblings share it."""

    cpu: int
    core: int
    package: int
    node: int


@dataclass(frozen=True, slots=True)
class GpuSlot:
    """One GPU and the NUMA node it hangs off (None when the platform does not say)."""

    index: int
    node: int | None


@dataclass(frozen=True, slots=True)
class MachineTopology:
    """The machine as the planner sees it: only the CPUs this process may use."""

    cpus: tuple[CpuSlot, ...]
    gpus: tuple[GpuSlot, ...] = ()


def affinity_topology() -> MachineTopology:
    """What the engine knows without sysfs: the CPUs it may use, each its own core, one node.

    The server passes the real topology (autotune/placement_topology.py); this is the
    fallback for the Python API.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return MachineTopology(tuple(CpuSlot(cpu, cpu, 0, 0) for cpu in allowed))


@dataclass(frozen=True, slots=True)
class WorkerPlacement:
    """Where worker `worker_index` runs. `node` is set when all its CPUs sit on one node (so its
    memory can be bound there); `gpu` is the device index on CUDA, else None."""

    worker_index: int
    cpus: tuple[int, ...]
    node: int | None
    gpu: int | None

    def as_dict(self) -> dict:
        return {"worker": self.worker_index, "cpus": format_cpulist(self.cpus),
                "node": self.node, "gpu": self.gpu}


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """One placement per worker, and notes saying what could not be honoured."""

    workers: tuple[WorkerPlacement, ...]
    notes: tuple[str, ...]

    def as_dict(self) -> dict:
        """The plan as plain data, for /stats and start-up lines."""
        return {"workers": [w.as_dict() for w in self.workers], "notes": list(self.notes)}

    def describe(self) -> list[str]:
        """One human line per worker, then the notes, for logs."""
        lines = [f"worker {w.worker_index}: cpus {format_cpulist(w.cpus)} node {w.node}"
                 + (f" gpu {w.gpu}" if w.gpu is not None else "") for w in self.workers]
        return lines + [f"note: {n}" for n in self.notes]


def format_cpulist(cpus) -> str:
    """CPU ids -> the kernel's compact form ("0-23,48-71"), short enough for a log line."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


# --- the public entry points ------------------------------------------------------------------

def plan_placement(
    topology: MachineTopology,
    process_count: int,
    threads_per_process: int,
    mode: PlacementMode = "auto",
    device: str = "cpu",
    workers_per_gpu: int = 1,
    explicit: tuple[tuple[int, ...], ...] | None = None,
) -> PlacementPlan:
    """Place `process_count` workers of `threads_per_process` threads each.

    mode `auto`: disjoint CPU sets, physical cores first, each worker inside one NUMA node when
    it fits, workers spread round-robin over nodes; on CUDA, worker i gets GPU
    i // workers_per_gpu (round-robin over devices) and CPUs on that GPU's node.
    mode `none`: every worker may use every allowed CPU (no pinning); GPUs still assigned.
    mode `explicit`: the given CPU lists, validated, one per worker.
    `device`: "cpu", "cuda", "cuda:N" (all workers on GPU N) or "auto" (cuda when GPUs are known).
    """
    _check_arguments(topology, process_count, threads_per_process, mode, workers_per_gpu)
    gpus, notes = _gpus_for(topology, device)
    if mode == "explicit":
        if explicit is None:
            raise PlacementError("placement 'explicit' needs one CPU list per worker")
        validate_explicit(topology, explicit, process_count)
        cpu_sets = [tuple(sorted(cpus)) for cpus in explicit]
        notes += _explicit_notes(cpu_sets, threads_per_process)
    elif mode == "none":
        everything = tuple(sorted(c.cpu for c in topology.cpus))
        cpu_sets = [everything] * process_count
    elif gpus:
        cpu_sets, more = _plan_gpu_cpus(topology, gpus, process_count, threads_per_process,
                                        workers_per_gpu)
        notes += more
    else:
        cpu_sets, more = _plan_cpu_auto(topology, process_count, threads_per_process)
        notes += more
    gpu_of = _assign_gpus(gpus, process_count, workers_per_gpu, notes)
    return _assemble(topology, cpu_sets, gpu_of, mode, notes)


def validate_explicit(
    topology: MachineTopology,
    explicit: tuple[tuple[int, ...], ...],
    process_count: int | None = None,
) -> None:
    """Raise PlacementError, naming the worker and the CPU, unless `explicit` is one non-empty
    list of distinct allowed CPUs per worker with no CPU shared between workers.

    Explicit lists are written by hand in a config file; a typo must stop start-up with a
    message that says what to fix, not pin a worker to a CPU it may not run on.
    """
    allowed = {c.cpu for c in topology.cpus}
    shown = format_cpulist(allowed)
    lists = list(explicit)
    if process_count is not None and len(lists) != process_count:
        raise PlacementError(
            f"explicit placement has {len(lists)} CPU list(s) but process_count is "
            f"{process_count}: give exactly one list per worker")
    owner: dict[int, int] = {}
    for w, cpus in enumerate(lists):
        if isinstance(cpus, (str, bytes)) or not hasattr(cpus, "__iter__"):
            raise PlacementError(f"explicit placement: worker {w}'s entry {cpus!r} is not a list of CPU ids")
        cpus = list(cpus)
        if not cpus:
            raise PlacementError(f"explicit placement: worker {w} has an empty CPU list")
        for cpu in cpus:
            _check_explicit_cpu(w, cpu, allowed, shown, owner)
            owner[cpu] = w


def _check_explicit_cpu(w: int, cpu, allowed: set[int], shown: str, owner: dict[int, int]) -> None:
    if isinstance(cpu, bool) or not isinstance(cpu, int):
        raise PlacementError(f"explicit placement: worker {w} lists {cpu!r}, which is not a CPU id")
    if cpu not in allowed:
        raise PlacementError(
            f"explicit placement: worker {w} lists CPU {cpu}, which is not among the CPUs this "
            f"process may use ({shown})")
    if cpu in owner:
        where = "twice" if owner[cpu] == w else f"for both worker {owner[cpu]} and worker {w}"
        raise PlacementError(f"explicit placement: CPU {cpu} is listed {where}; lists must not overlap")


# --- argument checks and GPUs -----------------------------------------------------------------

def _check_arguments(topology: MachineTopology, n: int, t: int, mode: PlacementMode, wpg: int) -> None:
    """Reject what no plan can satisfy, before any work, with the value in the message."""
    if mode not in MODES:
        raise PlacementError(f"placement mode {mode!r} is not one of {', '.join(MODES)}")
    for name, value in (("process_count", n), ("threads_per_process", t), ("workers_per_gpu", wpg)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlacementError(f"{name} must be a positive integer, got {value!r}")
    if not topology.cpus:
        raise PlacementError("the topology has no CPUs this process may use")
    ids = [c.cpu for c in topology.cpus]
    if len(set(ids)) != len(ids):
        raise PlacementError("the topology lists a CPU more than once")


def _gpus_for(topology: MachineTopology, device: str) -> tuple[list[GpuSlot], list[str]]:
    """The devices workers are spread over: none on CPU, all (or the one named) on CUDA.

    "cuda" on a machine whose GPUs are unknown (NVML unreadable) still gets a CPU plan, with a
    note, rather than no plan: the workers then choose their own device.
    """
    gpus = sorted(topology.gpus, key=lambda g: g.index)
    if device == "cpu" or (device == "auto" and not gpus):
        return [], []
    if device == "auto" or device == "cuda":
        chosen = gpus
    elif device.startswith("cuda:") and device[5:].isdigit():
        chosen = [g for g in gpus if g.index == int(device[5:])]
    else:
        raise PlacementError(f"device {device!r} is not 'cpu', 'auto', 'cuda' or 'cuda:N'")
    if not chosen:
        return [], [f"device {device}: no such GPU in the topology; CPU placement only, gpu unset"]
    return chosen, []


def _assign_gpus(gpus: list[GpuSlot], n: int, wpg: int, notes: list[str]) -> list[GpuSlot | None]:
    """Worker i -> GPU i // workers_per_gpu, round-robin when there are more workers than slots."""
    if not gpus:
        return [None] * n
    if n > wpg * len(gpus):
        notes.append(f"{n} workers > {len(gpus)} GPU(s) x {wpg} workers_per_gpu: devices wrap round "
                     "and carry more than workers_per_gpu workers")
    return [gpus[(i // wpg) % len(gpus)] for i in range(n)]


def _assemble(topology, cpu_sets, gpu_of, mode, notes) -> PlacementPlan:
    node_of = {c.cpu: c.node for c in topology.cpus}
    workers = []
    for i, cpus in enumerate(cpu_sets):
        nodes = {node_of[c] for c in cpus}
        node = nodes.pop() if len(nodes) == 1 and mode != "none" else None
        gpu = gpu_of[i]
        workers.append(WorkerPlacement(i, tuple(sorted(cpus)), node, None if gpu is None else gpu.index))
    return PlacementPlan(tuple(workers), tuple(dict.fromkeys(notes)))


def _explicit_notes(cpu_sets: list[tuple[int, ...]], t: int) -> list[str]:
    """Explicit lists are honoured as given; say where they and the thread count disagree."""
    return [f"worker {i} has {len(cpus)} CPU(s) for {t} threads"
            for i, cpus in enumerate(cpu_sets) if len(cpus) < t]


# --- CPU orderings ----------------------------------------------------------------------------

def _by_node(topology: MachineTopology) -> dict[int, list[CpuSlot]]:
    """Allowed CPUs grouped by NUMA node, nodes in id order."""
    groups: dict[int, list[CpuSlot]] = defaultdict(list)
    for c in topology.cpus:
        groups[c.node].append(c)
    return {node: groups[node] for node in sorted(groups)}


def _tiers(cpus: list[CpuSlot]) -> list[list[int]]:
    """Tier k holds the k-th hardware thread of every physical core, cores by lowest CPU id.

    Taking CPUs tier by tier is "physical cores before SMT siblings": every core's first thread
    is handed out before any core's second one.
    """
    cores: dict[tuple[int, int], list[int]] = defaultdict(list)
    for c in cpus:
        cores[(c.package, c.core)].append(c.cpu)
    threads = sorted(sorted(ids) for ids in cores.values())
    depth = max(len(ids) for ids in threads)
    return [[ids[k] for ids in threads if len(ids) > k] for k in range(depth)]


def _physical_first(cpus: list[CpuSlot]) -> list[int]:
    return [cpu for tier in _tiers(cpus) for cpu in tier]


def _global_order(by_node: dict[int, list[CpuSlot]]) -> list[int]:
    """All CPUs, physical first across the machine, then node by node within a tier.

    Used for workers that cannot stay inside one node: they take whole tiers of one node
    before the next, so they span as few nodes as possible.
    """
    ranked = []
    for node, cpus in by_node.items():
        for k, tier in enumerate(_tiers(cpus)):
            ranked += [(k, node, pos, cpu) for pos, cpu in enumerate(tier)]
    return [cpu for *_, cpu in sorted(ranked)]


def _take(order: list[int], start: int, k: int) -> tuple[int, ...]:
    """k CPUs from `order` beginning at `start`, wrapping round (oversubscription); never more
    CPUs than `order` holds, since a CPU listed twice pins nothing extra."""
    k = min(k, len(order))
    return tuple(order[(start + j) % len(order)] for j in range(k))


# --- auto on CPU ------------------------------------------------------------------------------

def _plan_cpu_auto(topology: MachineTopology, n: int, t: int) -> tuple[list[tuple[int, ...]], list[str]]:
    """Disjoint sets of t CPUs, physical first, one node per worker when it fits, balanced.

    When n x t fits in the physical cores, only first hardware threads are handed out (a
    worker spans nodes rather than take a sibling); when it fits only with siblings, all
    threads are; beyond that the CPUs wrap round and are shared.
    """
    by_node = _by_node(topology)
    total = len(topology.cpus)
    physical = len({(c.package, c.core) for c in topology.cpus})
    demand = n * t
    notes: list[str] = []
    oversubscribed = demand > total
    physical_only = demand <= physical
    if oversubscribed:
        notes.append(f"oversubscribed: {n} workers x {t} threads = {demand} > {total} allowed CPUs; "
                     "CPUs wrap round and are shared between workers")
    elif not physical_only:
        notes.append(f"SMT siblings in use: {demand} threads > {physical} physical cores")
    if t > total:
        notes.append(f"threads_per_process {t} exceeds the {total} allowed CPUs: "
                     "each worker gets all of them")
    pools = {node: (_tiers(cpus)[0] if physical_only else _physical_first(cpus))
             for node, cpus in by_node.items()}
    homes = _assign_nodes(pools, n, t, oversubscribed)
    sets = _fill_nodes(pools, homes, t)
    _fill_spanning(sets, homes, _global_order(by_node), t, oversubscribed)
    node_of = {c.cpu: c.node for c in topology.cpus}
    for i, cpus in enumerate(sets):
        spanned = sorted({node_of[c] for c in cpus})
        if len(spanned) > 1:
            notes.append(f"worker {i} spans NUMA nodes {spanned}: {t} threads do not fit in "
                         "one node's free CPUs")
    return sets, notes


def _assign_nodes(pools: dict[int, list[int]], n: int, t: int, oversubscribed: bool) -> list[int | None]:
    """Each worker's home node, or None when no node can hold it.

    Round-robin: the node with the fewest workers that still has t free CPUs, lowest id on a
    tie, so 3 workers on 2 nodes go 2/1. Oversubscribed, nodes take workers in proportion to
    their size instead, since every node will be shared anyway.
    """
    count = {node: 0 for node in pools}
    homes: list[int | None] = []
    for _ in range(n):
        if oversubscribed:
            fits = [node for node, pool in pools.items() if len(pool) >= t]
            key = lambda node: ((count[node] + 1) * t / len(pools[node]), node)  # noqa: E731
        else:
            fits = [node for node, pool in pools.items() if len(pool) - count[node] * t >= t]
            key = lambda node: (count[node], node)  # noqa: E731
        home = min(fits, key=key) if fits else None
        if home is not None:
            count[home] += 1
        homes.append(home)
    return homes


def _fill_nodes(pools: dict[int, list[int]], homes: list[int | None], t: int) -> list[tuple[int, ...]]:
    """Workers take t CPUs each from their home node's physical-first order, in worker order."""
    cursor = {node: 0 for node in pools}
    sets: list[tuple[int, ...]] = []
    for home in homes:
        if home is None:
            sets.append(())
            continue
        sets.append(_take(pools[home], cursor[home], t))
        cursor[home] += t
    return sets


def _fill_spanning(sets, homes, order, t, oversubscribed) -> None:
    """Workers without a home node take what the others left, across nodes."""
    used = {cpu for cpus in sets for cpu in cpus}
    # `order` is physical-first, so when n x t fits the physical cores the leftover's head is
    # enough first threads for every spanning worker: none of them gets a sibling.
    leftover = [cpu for cpu in order if cpu not in used] if not oversubscribed else []
    cursor = 0
    for i, home in enumerate(homes):
        if home is not None:
            continue
        if not oversubscribed and len(leftover) - cursor >= t:
            sets[i] = tuple(leftover[cursor:cursor + t])
        else:
            sets[i] = _take(order, cursor, t)
        cursor += t


# --- auto on CUDA -----------------------------------------------------------------------------

def _plan_gpu_cpus(topology, gpus, n, t, wpg) -> tuple[list[tuple[int, ...]], list[str]]:
    """Each worker's CPU threads from its GPU's own node, disjoint while that node has room.

    A GPU worker's host threads feed its device (tokens in, results out, kernel launches);
    on the GPU's node those copies cross no socket link. A GPU whose node is unknown, or whose
    node has no allowed CPUs, draws from all CPUs instead.
    """
    by_node = _by_node(topology)
    everything = _global_order(by_node)
    pools = {node: _physical_first(cpus) for node, cpus in by_node.items()}
    cursor: dict[int | None, int] = defaultdict(int)
    notes: list[str] = []
    sets: list[tuple[int, ...]] = []
    for i in range(n):
        gpu = gpus[(i // wpg) % len(gpus)]
        key = gpu.node if gpu.node in pools else None
        if key is None:
            notes.append(f"GPU {gpu.index}: NUMA node unknown or without allowed CPUs; "
                         "its workers' threads come from all CPUs")
        pool = pools[key] if key is not None else everything
        if cursor[key] + t > len(pool):
            where = f"node {key}" if key is not None else "the allowed CPUs"
            notes.append(f"oversubscribed: the workers of GPUs on {where} need more than its "
                         f"{len(pool)} CPUs; CPUs wrap round and are shared")
        sets.append(_take(pool, cursor[key], t))
        cursor[key] += t
    return sets, notes
