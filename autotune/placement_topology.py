"""The monitors' topology and GPU readings -> the engine's placement input.

engine/ may not import monitors/, so the planner (engine.placement) takes its own small types;
this adapter, in the composition root, is the one place that translates between the two.
"""

from __future__ import annotations

from engine.placement import CpuSlot, GpuSlot, MachineTopology
from monitors.gpu import GpuSample
from monitors.topology import Topology


def machine_topology(topology: Topology, gpus: tuple[GpuSample, ...] = ()) -> MachineTopology:
    """Only the CPUs this process may use (topology.allowed), and every GPU with its node.

    A CPU that no node lists (a partial sysfs) is put on node 0, as read_topology does for a
    machine without node directories. A GPU whose node is unknown but whose CPU affinity lies
    within one node gets that node: NVML may know the affinity when sysfs lacks numa_node.
    """
    cpus = tuple(
        CpuSlot(cpu=c.id, core=c.core_id, package=c.package_id, node=0 if c.node is None else c.node)
        for c in sorted(topology.cpus, key=lambda c: c.id)
        if c.id in topology.allowed
    )
    node_of = {c.id: c.node for c in topology.cpus}
    slots = tuple(
        GpuSlot(index=g.index, node=g.numa_node if g.numa_node is not None else _node_of_affinity(g, node_of))
        for g in sorted(gpus, key=lambda g: g.index)
    )
    return MachineTopology(cpus=cpus, gpus=slots)


def _node_of_affinity(gpu: GpuSample, node_of: dict[int, int | None]) -> int | None:
    nodes = {node_of.get(c) for c in gpu.cpu_affinity or ()}
    return nodes.pop() if len(nodes) == 1 else None
