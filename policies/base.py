"""What every policy shares: the Decision it returns, the Policy protocol, small helpers.

A policy is a small object with `decide(observation, knobs, bounds) -> Decision`. It may keep
state between calls (stabilization windows, a fitted model, a search), but it never reads a
clock, sleeps or does I/O: time comes in as `observation.time`. `bounds` is the effective range
(already narrowed by the controller to the hardware); a policy proposes values inside it, and the
controller clamps the proposal again anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict

from engine.config import Bounds, Knobs
from monitors.observation import Observation

KnobName = Literal["process_count", "threads_per_process", "io_threads", "batch_timeout", "max_batch_size", "max_batch_tokens", "kv_tokens"]
KNOB_NAMES: tuple[str, ...] = get_args(KnobName)
"""The knobs by name (tests check this matches the fields of Knobs)."""


@dataclass(frozen=True, slots=True)
class Decision:
    knobs: Knobs
    """The proposal (the controller clamps it to bounds and hardware limits afterwards)."""
    reason: str
    """In words, for the audit log, e.g. "busy 0.93 > target 0.70 (tolerance 0.10): process_count 2 -> 3"."""


class Policy(Protocol):
    name: str

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision: ...


class Params(BaseModel):
    """Base of every policy's parameters: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def describe_changes(before: Knobs, after: Knobs) -> str:
    """"process_count 2 -> 3, max_batch_size 16 -> 12", or "" when nothing changed."""
    parts = []
    for name in KNOB_NAMES:
        old, new = getattr(before, name), getattr(after, name)
        if old != new:
            parts.append(f"{name} {format_value(old)} -> {format_value(new)}")
    return ", ".join(parts)


def format_value(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def clamp_knob(bounds: Bounds, name: str, value):
    """`value` moved inside bounds' range for one knob."""
    lo, hi = getattr(bounds, name)
    return min(max(value, lo), hi)


def in_bounds(bounds: Bounds, name: str, value) -> bool:
    lo, hi = getattr(bounds, name)
    return lo <= value <= hi
