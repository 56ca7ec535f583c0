"""Guardrails around any policy: bounds from the machine, pins, and sanity. Pure functions.

A policy proposes; these decide what may actually be applied. They are the same for every
policy (custom ones too), the way Ray Serve wraps bounds and delays around any autoscaler.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.config import Bounds, Knobs


@dataclass(frozen=True, slots=True)
class MachineLimits:
    """What the hardware allows, on top of the configured bounds."""

    usable_cores: int
    """CPUs this process may run on (its affinity / cgroup cpuset)."""
    allow_oversubscription: bool = False
    """Allow process_count × threads_per_process above usable_cores."""
    memory_budget_bytes: int | None = None
    """Memory all workers together may use; None: no limit."""
    worker_memory_bytes: int | None = None
    """Memory one more worker costs (its USS, measured); with the budget, caps process_count."""
    workers_per_device: int | None = None
    """On GPU: workers per device times devices caps process_count."""
    devices: int = 0


def effective_bounds(bounds: Bounds, limits: MachineLimits, knobs: Knobs, pinned: frozenset[str] | set[str] = frozenset()) -> Bounds:
    """The configured bounds narrowed to the machine.

    process_count may go up to the cores over the fewest threads a worker may have: a policy
    that adds processes gets them, and `constrain` then takes threads away to fit, unless
    threads_per_process is pinned (then the current thread count divides the cores).
    """
    pc_lo, pc_hi = bounds.process_count
    tp_lo, tp_hi = bounds.threads_per_process
    if not limits.allow_oversubscription:
        tp_hi = max(tp_lo, min(tp_hi, limits.usable_cores))
        threads = knobs.threads_per_process if "threads_per_process" in pinned else tp_lo
        pc_hi = min(pc_hi, max(1, limits.usable_cores // max(1, threads)))
    if limits.memory_budget_bytes and limits.worker_memory_bytes:
        pc_hi = min(pc_hi, max(1, limits.memory_budget_bytes // limits.worker_memory_bytes))
    if limits.workers_per_device and limits.devices:
        pc_hi = min(pc_hi, limits.workers_per_device * limits.devices)
    pc_hi = max(pc_lo, pc_hi)
    return dataclasses.replace(bounds, process_count=(pc_lo, pc_hi), threads_per_process=(tp_lo, tp_hi))


def constrain(proposed: Knobs, current: Knobs, bounds: Bounds, limits: MachineLimits, pinned: set[str]) -> tuple[Knobs, list[str]]:
    """What may be applied of `proposed`, with a note for each thing changed on the way."""
    notes: list[str] = []
    values = dataclasses.asdict(proposed)
    for name in sorted(pinned):
        if values[name] != getattr(current, name):
            notes.append(f"{name} is pinned at {getattr(current, name)}; ignored {values[name]}")
            values[name] = getattr(current, name)
    knobs = Knobs(**values)
    clamped = bounds.clamp(knobs)
    for name, value in dataclasses.asdict(clamped).items():
        if value != getattr(knobs, name):
            notes.append(f"{name} {getattr(knobs, name)} clamped to {value} (bounds)")
    knobs = clamped
    if not limits.allow_oversubscription:
        knobs, note = _fit_cores(knobs, current, limits.usable_cores, pinned)
        if note:
            notes.append(note)
    machine = effective_bounds(bounds, limits, knobs)
    if knobs.process_count > machine.process_count[1]:
        notes.append(f"process_count {knobs.process_count} capped at {machine.process_count[1]} (memory / devices)")
        knobs = knobs.replace(process_count=machine.process_count[1])
    return knobs, notes


def _fit_cores(knobs: Knobs, current: Knobs, cores: int, pinned: set[str]) -> tuple[Knobs, str | None]:
    """Keep process_count × threads_per_process within the cores.

    The knob the policy did not change gives way (process_count when it changed both);
    a pinned knob never gives way unless both are pinned and still do not fit.
    """
    pc, tp = knobs.process_count, knobs.threads_per_process
    if pc * tp <= cores:
        return knobs, None
    only_processes_changed = pc != current.process_count and tp == current.threads_per_process
    threads_give = (only_processes_changed or "process_count" in pinned) and "threads_per_process" not in pinned
    if threads_give:
        tp = max(1, cores // pc)
    else:
        pc = max(1, cores // tp)
    if pc * tp > cores:
        tp = max(1, cores // pc)
        pc = max(1, cores // tp)
    fitted = knobs.replace(process_count=pc, threads_per_process=tp)
    return fitted, f"{knobs.process_count}×{knobs.threads_per_process} threads exceed {cores} cores: using {pc}×{tp}"


def is_sane(knobs: object) -> bool:
    """A policy's answer is usable: a Knobs whose values are finite numbers."""
    if not isinstance(knobs, Knobs):
        return False
    for value in dataclasses.asdict(knobs).values():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
    return True
