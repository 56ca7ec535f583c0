"""The policy loader: shipped policy files, bad files, kinds and knob names."""

from __future__ import annotations

import glob
import os
import re

import pytest
from policy_helpers import BOUNDS, obs

from engine.config import Knobs
from policies import PolicyError, load_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "policies", "*.yaml")))


def test_every_shipped_kind_has_a_file():
    names = {os.path.basename(p) for p in POLICY_FILES}
    assert {f"{k}.yaml" for k in ("static", "threshold", "aimd", "slo", "search", "composite", "default", "generate")} <= names


@pytest.mark.parametrize("path", POLICY_FILES, ids=os.path.basename)
def test_every_policy_file_loads_and_decides(path):
    policy = load_policy(path)
    knobs = Knobs(process_count=2)
    decision = policy.decide(obs(0, busy=0.8, p99=0.1, arrival=100, batch_size=4, model_mean=0.02), knobs, BOUNDS)
    assert isinstance(decision.knobs, Knobs) and decision.reason
    BOUNDS.validate(decision.knobs)


def test_default_policy_is_threshold_aimd_slo():
    policy = load_policy(os.path.join(ROOT, "configs", "policies", "default.yaml"))
    assert policy.name == "composite(threshold+aimd+slo)"
    owned = {p.kind: knobs for p, knobs in policy.members}
    assert owned == {"threshold": ("process_count", "threads_per_process"), "aimd": ("max_batch_size",), "slo": ("batch_timeout",)}
    assert policy.members[0][0].params.spread_threads and policy.members[1][0].params.model_budget_fraction == 0.5
    assert policy.members[0][0].params.target == 0.75


def write(tmp_path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("kind: threshold\ntarget: -1\n", r": target: Input should be greater than 0 \(got -1\)"),
        ("kind: threshold\ntarget: 0.7\ntargte: 1\n", r": targte: Extra inputs are not permitted; allowed keys: kind, metric, target"),
        ("kind: threshold\nmetric: cpu\n", r": metric: Input should be 'busy_fraction' or 'queue_depth' \(got 'cpu'\)"),
        ("kind: aimd\n", r": slo_p99_seconds: Field required"),
        ("kind: search\nslo_p99_seconds: 0.5\nknobs: [process_count, gpu_count]\n", r": knobs\[1\]: Input should be 'process_count'"),
        (
            "kind: composite\nmembers:\n  - policy: {kind: threshold, tolerance: 2}\n    knobs: [process_count]\n",
            r": members\[0\]\.policy: tolerance: Input should be less than 1 \(got 2\)",
        ),
        ("- kind: static\n", r": expected a mapping"),
        ("kind: [static\n", r": not valid YAML"),
        ("target: 0.7\n", r": kind: missing; one of: aimd, composite, generate, search, slo, static, threshold"),
    ],
)
def test_bad_files_name_the_file_and_the_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as error:
        load_policy(path)
    message = str(error.value)
    assert message.startswith(path + ": ")
    assert re.search(expected, message), message


def test_unknown_kind_lists_the_kinds(tmp_path):
    with pytest.raises(PolicyError, match=r"kind: unknown policy kind 'pid'; one of: aimd, composite, generate, search, slo, static, threshold"):
        load_policy(write(tmp_path, "kind: pid\n"))


@pytest.mark.parametrize("kind", ["policies.threshold:ThresholdPolicy", "os.system", "mypkg/policy"])
def test_import_path_kinds_are_rejected(tmp_path, kind):
    with pytest.raises(PolicyError, match="looks like an import path"):
        load_policy(write(tmp_path, f"kind: '{kind}'\n"))


def test_missing_file_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(str(tmp_path / "nope.yaml"))


def test_knob_names_match_the_knobs():
    import dataclasses

    from policies.base import KNOB_NAMES

    assert set(KNOB_NAMES) == {f.name for f in dataclasses.fields(Knobs)}
