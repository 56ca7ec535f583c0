"""One policy per knob group: each member decides, the result takes each member's own knobs.

    members:
      - policy: {kind: threshold, metric: busy_fraction, target: 0.75}
        knobs: [process_count]
      - policy: {kind: aimd, slo_p99_seconds: 0.5}
        knobs: [max_batch_size]

Every member sees the same observation and the same current knobs on every decision (stateful
members keep learning even while they change nothing). A knob belongs to at most one member;
knobs nobody owns keep their values. The reason joins the reasons of the members that changed
one of their knobs, each prefixed with the member's name.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import Field, field_validator

from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import Decision, KnobName, Params, Policy


class MemberSpec(Params):
    policy: dict[str, Any]
    """An inline policy spec: {kind: ..., ...its parameters}, as in a policy file."""
    knobs: list[KnobName] = Field(min_length=1)
    """The knobs this member decides; its proposals for other knobs are ignored."""


class CompositeParams(Params):
    members: list[MemberSpec] = Field(min_length=1)
    """The member policies and the knobs each one owns (each knob at most once)."""

    @field_validator("members")
    @classmethod
    def _each_knob_owned_once(cls, members: list[MemberSpec]) -> list[MemberSpec]:
        check_ownership([m.knobs for m in members])
        return members


def check_ownership(knob_groups: Sequence[Sequence[str]]) -> None:
    owner: dict[str, int] = {}
    for index, knobs in enumerate(knob_groups):
        for knob in knobs:
            if knob in owner:
                raise ValueError(
                    f"knob {knob!r} is owned by members {owner[knob]} and {index}; each knob may belong to one member only"
                )
            owner[knob] = index


class CompositePolicy:
    """Routes each knob to the one member policy that owns it."""

    kind = "composite"

    def __init__(self, members: Sequence[tuple[Policy, Sequence[str]]]):
        if not members:
            raise ValueError("a composite policy needs at least one member")
        check_ownership([knobs for _, knobs in members])
        self.members = [(policy, tuple(knobs)) for policy, knobs in members]
        self.name = "composite(" + "+".join(policy.name for policy, _ in self.members) + ")"

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        changes: dict[str, Any] = {}
        changed_reasons, all_reasons = [], []
        for policy, owned in self.members:
            decision = policy.decide(observation, knobs, bounds)
            mine = {k: getattr(decision.knobs, k) for k in owned}
            changes.update(mine)
            text = f"{policy.name}: {decision.reason}"
            all_reasons.append(text)
            if any(getattr(knobs, k) != v for k, v in mine.items()):
                changed_reasons.append(text)
        result = knobs.replace(**changes)
        if changed_reasons:
            return Decision(result, "; ".join(changed_reasons))
        return Decision(result, "no change (" + "; ".join(all_reasons) + ")")
