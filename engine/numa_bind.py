"""Applying a placement inside a worker: pin its CPUs, and (optionally) bind its memory.

CPU pinning needs only os.sched_setaffinity. Memory binding needs libnuma, which many machines
lack (no numactl package, containers, non-Linux); it is loaded with ctypes when present, and its
absence is never an error: the worker is still pinned, and the kernel's first-touch policy
already puts most pages on the node of the CPU that touches them. torch-free on purpose: the
worker sets torch's thread count itself (torch.set_num_threads), after pinning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("selftune.engine")

_UNLOADED = object()
_libnuma: object = _UNLOADED


def _load_libnuma() -> ctypes.CDLL | None:
    """libnuma with the prototypes used here, or None when absent or unusable. Cached."""
    global _libnuma
    if _libnuma is not _UNLOADED:
        return _libnuma  # type: ignore[return-value]
    _libnuma = None
    name = ctypes.util.find_library("numa")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name, use_errno=True)
        lib.numa_available.restype = ctypes.c_int
        lib.numa_max_node.restype = ctypes.c_int
        lib.numa_set_preferred.argtypes = [ctypes.c_int]
        lib.numa_set_preferred.restype = None
        lib.numa_preferred.restype = ctypes.c_int
        lib.numa_allocate_nodemask.restype = ctypes.c_void_p
        lib.numa_bitmask_setbit.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.numa_bitmask_setbit.restype = ctypes.c_void_p
        lib.numa_bitmask_isbitset.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.numa_bitmask_isbitset.restype = ctypes.c_int
        lib.numa_bitmask_free.argtypes = [ctypes.c_void_p]
        lib.numa_bitmask_free.restype = None
        lib.numa_set_membind.argtypes = [ctypes.c_void_p]
        lib.numa_set_membind.restype = None
        lib.numa_get_membind.restype = ctypes.c_void_p
    except (OSError, AttributeError) as e:
        log.info("libnuma at %s unusable (%s): memory binding off", name, e)
        return None
    _libnuma = lib
    return lib


def libnuma_available() -> bool:
    """True when libnuma loads and the kernel supports NUMA (numa_available() >= 0)."""
    lib = _load_libnuma()
    try:
        return lib is not None and lib.numa_available() >= 0
    except OSError:
        return False


def bind_memory_to_node(node: int, strict: bool = False) -> bool:
    """Put this process's future allocations on `node`; False (never an exception) when it
    cannot be done: no libnuma, no NUMA support, or no such node.

    Default: numa_set_preferred, so allocation falls back to other nodes when `node` is full
    instead of the worker being OOM-killed. strict=True uses numa_set_membind (only `node`).
    Pages already touched (the zygote's shared weights) stay where they are.
    """
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        return False
    lib = _load_libnuma()
    if lib is None:
        return False
    try:
        if lib.numa_available() < 0 or node > lib.numa_max_node():
            return False
        return _membind(lib, node) if strict else _prefer(lib, node)
    except OSError as e:  # a libnuma call that faults is reported as a failed binding
        log.info("binding memory to node %d failed: %s", node, e)
        return False


def _prefer(lib: ctypes.CDLL, node: int) -> bool:
    lib.numa_set_preferred(node)
    return lib.numa_preferred() == node


def _membind(lib: ctypes.CDLL, node: int) -> bool:
    mask = lib.numa_allocate_nodemask()
    if not mask:
        return False
    try:
        lib.numa_bitmask_setbit(mask, node)
        lib.numa_set_membind(mask)
    finally:
        lib.numa_bitmask_free(mask)
    current = lib.numa_get_membind()
    if not current:
        return False
    try:
        return bool(lib.numa_bitmask_isbitset(current, node))
    finally:
        lib.numa_bitmask_free(current)


def pin_current_process(cpus) -> None:
    """Restrict this process to `cpus`: every thread it has now, and (by inheritance) later.

    sched_setaffinity(0, ...) moves only the calling thread, so a live re-pin walks
    /proc/self/task: the OpenMP pool of a running worker moves too. Raises ValueError on an
    empty set and OSError when the kernel refuses (a CPU outside the cgroup): a worker that
    silently ran unpinned would make the plan a lie.
    """
    cpus = {int(c) for c in cpus}
    if not cpus:
        raise ValueError("pin_current_process: empty CPU set")
    if not hasattr(os, "sched_setaffinity"):
        log.info("this platform cannot pin CPUs; placement is advisory")
        return
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def current_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on now (what /proc/self/status calls Cpus_allowed_list)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class BindResult:
    """What applying a placement did, for the worker's start-up line and /stats."""

    cpus: tuple[int, ...]
    memory_node: int | None  # the node memory is bound to; None when not bound


def apply_placement(cpus, node: int | None, bind_memory: bool = True) -> BindResult:
    """Pin to `cpus`, then bind memory to `node` when there is one node and libnuma allows."""
    pin_current_process(cpus)
    bound = node is not None and bind_memory and bind_memory_to_node(node)
    return BindResult(current_cpus(), node if bound else None)
