"""Decisions: (Observation, Knobs, Bounds) -> Decision. Pure, no I/O, time from the Observation."""

from policies.base import Decision, Policy
from policies.loader import KINDS, PolicyError, load_policy, policy_from_spec

__all__ = ["Decision", "Policy", "KINDS", "PolicyError", "load_policy", "policy_from_spec"]
