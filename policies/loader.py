"""Policy files: YAML naming one of the shipped kinds and its parameters, turned into a Policy.

    kind: threshold          # one of KINDS, never an import path
    metric: busy_fraction
    target: 0.7

Policies are only ever the shipped kinds: a request or a file can choose among them and set
their parameters, but never name code to import. Every error is a `PolicyError` whose message
names the file, the key and what is allowed.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ValidationError

from policies.aimd import AimdParams, AimdPolicy
from policies.base import Policy
from policies.composite import CompositeParams, CompositePolicy
from policies.generate import GenerateParams, GeneratePolicy
from policies.replicas import ReplicaParams, ReplicaPolicy
from policies.search import SearchParams, SearchPolicy
from policies.slo import SloParams, SloPolicy
from policies.static import StaticParams, StaticPolicy
from policies.threshold import ThresholdParams, ThresholdPolicy


class PolicyError(ValueError):
    """A policy file or spec that cannot be used; the message names the file and the key."""


KINDS: dict[str, tuple[type[BaseModel], Callable[[Any], Policy] | None]] = {
    "static": (StaticParams, StaticPolicy),
    "threshold": (ThresholdParams, ThresholdPolicy),
    "aimd": (AimdParams, AimdPolicy),
    "slo": (SloParams, SloPolicy),
    "search": (SearchParams, SearchPolicy),
    "generate": (GenerateParams, GeneratePolicy),
    "composite": (CompositeParams, None),  # built below: its members are specs themselves
}

_IMPORT_PATH = re.compile(r"[.:/]")


def load_policy(path: str) -> Policy:
    """Read a policy file and build its policy."""
    return policy_from_spec(_read(path), path)


def load_replica_policy(path: str) -> ReplicaPolicy:
    """Read a cluster policy file (`kind: replicas`): the other kind of policy, which sizes the set
    of replicas and never the knobs, so it is not among KINDS."""
    return replica_policy_from_spec(_read(path), path)


def replica_policy_from_spec(spec: dict, source: str) -> ReplicaPolicy:
    if not isinstance(spec, dict) or spec.get("kind") != ReplicaPolicy.kind:
        got = spec.get("kind") if isinstance(spec, dict) else type(spec).__name__
        raise PolicyError(f"{source}: kind: a cluster policy file has kind: {ReplicaPolicy.kind} (got {got!r})")
    try:
        return ReplicaPolicy(ReplicaParams.model_validate({k: v for k, v in spec.items() if k != "kind"}))
    except ValidationError as e:
        raise PolicyError(_format_errors(source, e, ReplicaParams)) from None


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            spec = yaml.safe_load(f)
    except OSError as e:
        raise PolicyError(f"{path}: cannot read the policy file: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PolicyError(f"{path}: not valid YAML: {e}") from None
    return spec


def policy_from_spec(spec: dict, source: str) -> Policy:
    """Build a policy from a mapping {kind: ..., ...parameters}; `source` names it in errors."""
    if not isinstance(spec, dict):
        raise PolicyError(f"{source}: expected a mapping with a `kind` key, got {type(spec).__name__}")
    kind = _kind(spec, source)
    params_model, factory = KINDS[kind]
    values = {k: v for k, v in spec.items() if k != "kind"}
    try:
        params = params_model.model_validate(values)
    except ValidationError as e:
        raise PolicyError(_format_errors(source, e, params_model)) from None
    if kind == "composite":
        return _composite(params, source)
    return factory(params)


def _kind(spec: dict, source: str) -> str:
    kinds = ", ".join(sorted(KINDS))
    kind = spec.get("kind")
    if kind is None:
        raise PolicyError(f"{source}: kind: missing; one of: {kinds}")
    if not isinstance(kind, str):
        raise PolicyError(f"{source}: kind: expected one of {kinds} (got {kind!r})")
    if _IMPORT_PATH.search(kind):
        raise PolicyError(
            f"{source}: kind: {kind!r} looks like an import path; policies are never loaded from code "
            f"named in a file or a request, use one of: {kinds}"
        )
    if kind not in KINDS:
        raise PolicyError(f"{source}: kind: unknown policy kind {kind!r}; one of: {kinds}")
    return kind


def _composite(params: CompositeParams, source: str) -> Policy:
    members = [
        (policy_from_spec(member.policy, f"{source}: members[{i}].policy"), member.knobs)
        for i, member in enumerate(params.members)
    ]
    return CompositePolicy(members)


def _format_errors(source: str, error: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for item in error.errors():
        key = _key(item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message += f"; allowed keys: kind, {', '.join(model.model_fields)}"
        elif item["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        elif item["type"] != "missing":
            message += f" (got {item['input']!r})"
        lines.append(f"{source}: {key}: {message}")
    return "\n".join(lines)


def _key(loc: tuple) -> str:
    """('members', 0, 'knobs', 1) -> 'members[0].knobs[1]'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
