"""The composite policy: each knob routed to the one member that owns it."""

from __future__ import annotations

import pytest
from policy_helpers import BOUNDS, aimd, obs, threshold

from engine.config import Knobs
from policies import Decision, PolicyError, policy_from_spec
from policies.composite import CompositePolicy
from policies.static import StaticPolicy


class EverythingUp:
    """A member that proposes +1 on every integer knob (to show ownership filters it)."""

    name = "everything-up"

    def decide(self, observation, knobs, bounds):
        return Decision(
            knobs.replace(process_count=knobs.process_count + 1, io_threads=knobs.io_threads + 1, max_batch_size=knobs.max_batch_size + 1),
            "everything up",
        )


def test_composite_routes_each_knob_to_its_owner():
    composite = CompositePolicy(
        [(threshold(target=0.7), ["process_count"]), (aimd(), ["max_batch_size"]), (EverythingUp(), ["io_threads"])]
    )
    knobs = Knobs(process_count=2, max_batch_size=32, io_threads=2, batch_timeout=0.01)
    decision = composite.decide(obs(0, busy=0.95, workers=2, p99=0.8), knobs, BOUNDS)
    assert decision.knobs == Knobs(process_count=3, max_batch_size=24, io_threads=3, batch_timeout=0.01)
    assert "threshold: busy 0.95" in decision.reason and "aimd: total p99" in decision.reason
    assert "everything-up: everything up" in decision.reason
    assert composite.name == "composite(threshold+aimd+everything-up)"


def test_composite_reason_keeps_only_members_that_changed_something():
    composite = CompositePolicy([(threshold(target=0.7), ["process_count"]), (EverythingUp(), ["io_threads"])])
    decision = composite.decide(obs(0, busy=0.7, workers=2), Knobs(process_count=2), BOUNDS)
    assert decision.reason == "everything-up: everything up"
    static_only = CompositePolicy([(StaticPolicy(), ["process_count"])])
    assert static_only.decide(obs(0), Knobs(), BOUNDS).reason.startswith("no change (static:")


def test_composite_rejects_a_knob_owned_twice():
    with pytest.raises(ValueError, match="process_count"):
        CompositePolicy([(StaticPolicy(), ["process_count"]), (threshold(), ["io_threads", "process_count"])])
    spec = {
        "kind": "composite",
        "members": [
            {"policy": {"kind": "static"}, "knobs": ["max_batch_size"]},
            {"policy": {"kind": "aimd", "slo_p99_seconds": 0.5}, "knobs": ["max_batch_size"]},
        ],
    }
    with pytest.raises(PolicyError, match=r"^x\.yaml: members: knob 'max_batch_size' is owned by members 0 and 1"):
        policy_from_spec(spec, "x.yaml")
