"""HPA's stabilization window: remembered recommendations that hold back a change in count.

A scale-up goes to the MIN of the recommendations over the last `up_seconds` (all of them must
ask for more), a scale-down to the MAX over the last `down_seconds` (the whole window must ask
for less). Until a full window has been seen, the current count counts as a recommendation
too, so a new policy never scales on less than a window. Time comes in as an argument.
"""

from __future__ import annotations

from collections import deque


class Stabilizer:
    def __init__(self, up_seconds: float, down_seconds: float):
        self.up_seconds = up_seconds
        self.down_seconds = down_seconds
        self._recommendations: deque[tuple[float, int]] = deque()
        self._first_seen: float | None = None

    def stabilize(self, now: float, current: int, desired: int) -> tuple[int, str]:
        """The count to go to now, and what held it back ("" when nothing did)."""
        if self._first_seen is None:
            self._first_seen = now
        self._recommendations.append((now, desired))
        cutoff = now - max(self.up_seconds, self.down_seconds)
        while self._recommendations and self._recommendations[0][0] < cutoff:
            self._recommendations.popleft()
        up = min([r for t, r in self._recommendations if t >= now - self.up_seconds] + [desired])
        down = max([r for t, r in self._recommendations if t >= now - self.down_seconds] + [desired])
        if now - self._first_seen < self.down_seconds:
            down = max(down, current)  # a window not yet seen in full counts as "keep the current count"
        if now - self._first_seen < self.up_seconds:
            up = min(up, current)
        stabilized = min(max(current, up), down)
        held_by = ""
        if desired > current and stabilized < desired:
            held_by = f"scale-up stabilization (min over last {self.up_seconds:g} s = {up})"
        elif desired < current and stabilized > desired:
            held_by = f"scale-down stabilization (max over last {self.down_seconds:g} s = {down})"
        return stabilized, held_by


def limit_step(current: int, stabilized: int, max_step_up: int, max_step_down: int) -> int:
    return min(max(stabilized, current - max_step_down), current + max_step_up)


def count_reason(comparison: str, what: str, current: int, desired: int, new: int, held_by: str) -> str:
    """The audit line of a count decision, e.g. "busy 0.93 > target 0.70: process_count 2 -> 3"."""
    if new != current:
        note = f" (wants {desired}; step or bounds limit)" if new != desired else ""
        return f"{comparison}: {what} {current} -> {new}{note}"
    if desired != current:
        return f"{comparison}: wants {desired}, held at {current} by {held_by or 'step or bounds limit'}"
    return f"{comparison}: {what} stays {current}"
