"""Which CPUs a node of a local test cluster stands for.

`selftune serve --ray local:N` starts N Ray nodes on one machine; each is given a custom
resource `selftune_cpu_<i>` per CPU it stands for, so that the replica landing on it keeps its
engine to those CPUs, as it would own a real machine's. On a real cluster no node has them.
"""

from __future__ import annotations

import os

CPU_RESOURCE = "selftune_cpu_"


def node_resources(index: int, cpus_per_node: int) -> dict[str, float]:
    """The custom resources of local node `index`: its share of this machine's CPUs (wrapping
    round when the nodes ask for more CPUs than there are)."""
    usable = sorted(os.sched_getaffinity(0))
    chosen = [usable[(index * cpus_per_node + k) % len(usable)] for k in range(cpus_per_node)]
    return {f"{CPU_RESOURCE}{cpu}": 1.0 for cpu in chosen}


def local_node_cpus() -> set[int]:
    """The CPUs this process's Ray node stands for; empty on a real node (use them all)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return {int(name[len(CPU_RESOURCE):]) for name in node.get("Resources", {}) if name.startswith(CPU_RESOURCE)}
    return set()
