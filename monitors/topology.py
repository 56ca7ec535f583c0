"""CPU and NUMA topology from sysfs.

Placement (which cores and which NUMA node each worker gets) needs to know which logical CPUs
share a physical core, which share a socket and which share a memory node. The kernel says so
under /sys/devices/system/{cpu,node}; this module reads exactly those files from a root that a
test can point at a recorded tree. Absent files never raise: the reading falls back to a
simpler shape and says why in `Topology.notes`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_CPU_DIR = re.compile(r"^cpu(\d+)$")
_NODE_DIR = re.compile(r"^node(\d+)$")


@dataclass(frozen=True, slots=True)
class Cpu:
    """One logical CPU: which core and socket it belongs to, so SMT siblings can be told apart."""

    id: int
    core_id: int
    package_id: int
    node: int | None
    siblings: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NumaNode:
    """A memory node and its CPUs; memory figures are the node's own (None if unreadable)."""

    id: int
    cpus: tuple[int, ...]
    mem_total_bytes: int | None
    mem_free_bytes: int | None


@dataclass(frozen=True, slots=True)
class Topology:
    """The machine as placement sees it; `allowed` is the CPUs this process may run on."""

    nodes: tuple[NumaNode, ...]
    cpus: tuple[Cpu, ...]
    allowed: frozenset[int]
    notes: tuple[str, ...] = ()

    @property
    def sockets(self) -> int:
        """Distinct physical packages."""
        return len({c.package_id for c in self.cpus})

    @property
    def physical_cores(self) -> int:
        """Distinct (package, core) pairs: SMT siblings count once."""
        return len({(c.package_id, c.core_id) for c in self.cpus})

    @property
    def smt(self) -> bool:
        """True when some physical core runs more than one logical CPU."""
        return any(len(c.siblings) > 1 for c in self.cpus)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel cpulist ("0-23,48-71", "0", "", "0-7:2") into sorted CPU ids.

    Raises ValueError on text that is not a cpulist (a reader bug, not a missing file).
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:  # "0-7:2" (and the rarer "0-7:2/4") stride syntax
            part, _, step = part.partition(":")
            stride = int(step.split("/")[0])
        if "-" in part:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi)
            if last < first or stride < 1:
                raise ValueError(f"bad cpulist range {part!r}")
            cpus.update(range(first, last + 1, stride))
        else:
            cpus.add(int(part))
    return tuple(sorted(cpus))


def parse_node_meminfo(text: str) -> dict[str, int]:
    """Parse nodeN/meminfo ("Node 0 MemTotal:  263856000 kB") into {field: bytes or count}."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[0] != "Node":
            continue
        key = parts[2].rstrip(":")
        try:
            value = int(parts[3])
        except ValueError:
            continue
        fields[key] = value * 1024 if len(parts) > 4 and parts[4] == "kB" else value
    return fields


def read_text(path: str) -> str | None:
    """A small kernel file (sysfs, /proc) as text; None when it is absent or unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = read_text(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _numbered_dirs(path: str, pattern: re.Pattern[str]) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


def _cpu_ids(cpu_root: str, notes: list[str]) -> list[int]:
    ids = _numbered_dirs(cpu_root, _CPU_DIR)
    if not ids:
        notes.append(f"no cpuN directories under {cpu_root}")
        return []
    online = read_text(os.path.join(cpu_root, "online"))
    if online is None:
        return ids
    online_ids = set(parse_cpulist(online))
    offline = [i for i in ids if i not in online_ids]
    if offline:
        notes.append(f"offline CPUs left out: {offline}")
    return [i for i in ids if i in online_ids]


def _read_nodes(node_root: str, cpu_ids: list[int], notes: list[str]) -> list[NumaNode]:
    node_ids = _numbered_dirs(node_root, _NODE_DIR)
    if not node_ids:
        notes.append(f"no NUMA nodes under {node_root}: assumed one node with all CPUs")
        return [NumaNode(0, tuple(cpu_ids), None, None)]
    known = set(cpu_ids)
    nodes = []
    for n in node_ids:
        base = os.path.join(node_root, f"node{n}")
        cpulist = read_text(os.path.join(base, "cpulist"))
        cpus = tuple(c for c in parse_cpulist(cpulist) if c in known) if cpulist else ()
        meminfo = read_text(os.path.join(base, "meminfo"))
        mem = parse_node_meminfo(meminfo) if meminfo else {}
        if meminfo is None:
            notes.append(f"node{n}: meminfo unreadable")
        nodes.append(NumaNode(n, cpus, mem.get("MemTotal"), mem.get("MemFree")))
    return nodes


def _read_cpu(cpu_root: str, cpu: int, node: int | None, notes: list[str]) -> Cpu:
    base = os.path.join(cpu_root, f"cpu{cpu}", "topology")
    core_id = _read_int(os.path.join(base, "core_id"))
    package_id = _read_int(os.path.join(base, "physical_package_id"))
    siblings_text = read_text(os.path.join(base, "thread_siblings_list"))
    if core_id is None or package_id is None or siblings_text is None:
        notes.append(f"cpu{cpu}: topology incomplete, treated as its own core on package 0")
    siblings = parse_cpulist(siblings_text) if siblings_text else (cpu,)
    return Cpu(
        id=cpu,
        core_id=cpu if core_id is None else core_id,
        package_id=0 if package_id is None else package_id,
        node=node,
        siblings=siblings or (cpu,),
    )


def read_topology(sys_root: str = "/sys", allowed_cpus: set[int] | None = None) -> Topology:
    """Read the CPU/NUMA topology under `sys_root`.

    `allowed` is `allowed_cpus` when given, else this process's affinity when reading the real
    /sys, else every CPU found (a recorded tree says nothing about the reader's affinity).
    """
    notes: list[str] = []
    cpu_root = os.path.join(sys_root, "devices", "system", "cpu")
    cpu_ids = _cpu_ids(cpu_root, notes)
    nodes = _read_nodes(os.path.join(sys_root, "devices", "system", "node"), cpu_ids, notes)
    node_of = {c: node.id for node in nodes for c in node.cpus}
    cpus = tuple(_read_cpu(cpu_root, c, node_of.get(c), notes) for c in cpu_ids)
    if allowed_cpus is not None:
        allowed = frozenset(allowed_cpus)
    elif os.path.normpath(sys_root) == "/sys" and hasattr(os, "sched_getaffinity"):
        allowed = frozenset(os.sched_getaffinity(0))
    else:
        allowed = frozenset(cpu_ids)
    return Topology(nodes=tuple(nodes), cpus=cpus, allowed=allowed, notes=tuple(notes))
