"""The static policy: it never changes a knob."""

from __future__ import annotations

from policy_helpers import BOUNDS, obs

from engine.config import Knobs
from policies import Decision
from policies.static import StaticPolicy


def test_static_never_changes_anything():
    policy = StaticPolicy()
    knobs = Knobs(process_count=2, max_batch_size=8)
    for t, busy, p99 in [(0, 0.99, 5.0), (1, 0.0, None), (2, 0.5, 0.01)]:
        decision = policy.decide(obs(t, busy=busy, p99=p99, arrival=100), knobs, BOUNDS)
        assert decision == Decision(knobs, "static policy: knobs stay as configured")
