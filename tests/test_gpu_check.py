"""scripts/gpu_check.sh --dry-run (issue #24): runs what needs no CUDA, skips the rest, exits 0.

One real dry run (about a minute on 2 cores: real servers on CPU, the real models), then its
gpu_check.json is read: every step listed with a status, the CUDA steps skipped with a reason,
the others passed, and the budgets of a GPU run under 8 minutes. The dry run is opt-in (-m slow):
its CPU stand-in serves what the server tests already serve, and a minute of it kept the suite
past its 15 minutes on CI. The step table's own checks run without it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_STEPS = {"fork_probe", "serve_embed_wpg1", "serve_embed_wpg2", "serve_generate", "stream_generate", "bench_embed"}
STATUSES = {"passed", "failed", "skipped"}


@pytest.fixture(scope="module")
def driver():
    """scripts/gpu_check.py as a module, for its step table."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--python", sys.executable, "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    summary = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return done, out, summary


def steps_of(summary) -> dict[str, dict]:
    return {step["name"]: step for step in summary["steps"]}


@pytest.mark.slow
def test_the_dry_run_exits_0_and_prints_the_summary_table(dry_run):
    done, out, summary = dry_run
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert summary is not None and summary["mode"] == "dry-run" and summary["ok"]
    assert "| step | status | seconds | budget | result |" in done.stdout
    assert (out / "gpu_check.md").read_text().startswith("# GPU check (dry-run)")
    assert "step 6/11 cpu_standin" in done.stderr  # a progress line per step, with elapsed time


@pytest.mark.slow
def test_every_step_is_listed_with_a_status(dry_run, driver):
    _, _, summary = dry_run
    names = [step["name"] for step in summary["steps"]]
    assert names == ["install"] + [s.name for s in driver.STEPS] + ["report"]
    for step in summary["steps"]:
        assert step["status"] in STATUSES, step
        assert isinstance(step["seconds"], (int, float)) and step["budget_s"] > 0
        assert step["status"] != "skipped" or step.get("reason"), f"{step['name']} skipped without a reason"


def test_the_cuda_steps_and_the_budget_of_a_gpu_run(driver):
    """From the step table alone: which steps need CUDA, and a GPU run's budgets under 8 minutes."""
    assert {s.name for s in driver.STEPS if s.needs_cuda} == CUDA_STEPS
    assert driver.budgets(False)["budget_gpu_run_s"] < 480


@pytest.mark.slow
def test_cuda_steps_are_skipped_with_the_reason(dry_run, driver):
    _, _, summary = dry_run
    for name, step in steps_of(summary).items():
        if name in CUDA_STEPS:
            assert step["status"] == "skipped" and step["reason"] == "dry run: needs CUDA", step


@pytest.mark.slow
def test_the_steps_that_need_no_cuda_passed(dry_run):
    _, _, summary = dry_run
    steps = steps_of(summary)
    for name in ("environment", "references", "configs", "gpu_tests", "cpu_standin", "report"):
        assert steps[name]["status"] == "passed", f"{name}: {steps[name].get('error')}"
    assert steps["install"]["status"] == "skipped" and "--install" in steps["install"]["reason"]
    tests = steps["gpu_tests"]["details"]
    assert "skipped" in tests["result"] and "passed" not in tests["result"], tests  # no CUDA here: they skip
    standin = steps["cpu_standin"]["details"]
    assert standin["cpu-embed"]["answers"]["min_cosine"] >= 0.999
    assert all(p["equal"] for p in standin["cpu-generate"]["answers"]["prompts"])
    assert standin["cpu-generate"]["stream"]["output_tokens"] > 0


@pytest.mark.slow
def test_budgets_of_a_gpu_run_add_up_to_under_8_minutes(dry_run, driver):
    _, _, summary = dry_run
    gpu_run = [s for s in summary["steps"] if not s["dry_run_only"]]
    total = sum(s["budget_s"] for s in gpu_run)
    assert total == summary["budget_gpu_run_s"] == driver.budgets(False)["budget_gpu_run_s"]
    assert total < 480
    assert summary["seconds"] < summary["budget_dry_run_s"]
