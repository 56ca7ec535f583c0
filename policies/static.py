"""The static policy: the knobs stay as configured (the baseline every other policy is compared to)."""

from __future__ import annotations

from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import Decision, Params


class StaticParams(Params):
    """The static policy takes no parameters."""


class StaticPolicy:
    """Never changes anything."""

    kind = "static"

    def __init__(self, params: StaticParams | None = None):
        self.params = params or StaticParams()
        self.name = self.kind

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        return Decision(knobs, "static policy: knobs stay as configured")
