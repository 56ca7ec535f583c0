"""`selftune validate`: live server and simulator on the same workload, compared."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from autotune.offline.validate import compare, relative_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summary(throughput: float, p50: float, p99: float) -> dict:
    return {"throughput_in_window": throughput, "goodput": throughput, "latency_seconds": {"p50": p50, "p99": p99}}


def test_compare_applies_the_tolerances():
    close = compare(summary(100, 0.050, 0.200), summary(95, 0.058, 0.170))
    assert close["throughput"]["within"] and close["p50"]["within"] and close["p99"]["within"]
    assert math.isclose(close["throughput"]["error"], -0.05)
    off = compare(summary(100, 0.050, 0.200), summary(85, 0.070, 0.300))
    assert not off["throughput"]["within"] and not off["p50"]["within"] and not off["p99"]["within"]
    assert relative_error(1.0, 0.0) == math.inf and relative_error(math.nan, 1.0) == math.inf


@pytest.mark.slow  # ~70 s: a live calibration, then live and simulated runs; the suite passed 15 min with it (opt in: -m slow)
def test_validate_cli_calibrates_then_runs_live_and_simulated_side_by_side(tmp_path):
    cost_model = tmp_path / "costmodel.json"
    shutil.copy(os.path.join(ROOT, "configs", "costmodels", "epyc-2core-minilm.json"), cost_model)
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "validate", "--rates", "10", "--seconds", "4", "--length", "16",
         "--knobs", "process_count=1,max_batch_size=4", "--cost-model", str(cost_model), "--calibrate", "--calibrate-rate", "30",
         "--out", str(tmp_path / "out"), "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["rows"][0]
    assert row["workload"] == "poisson 10/s"
    assert row["live"]["statuses"] == {"200": row["live"]["requests"]} and row["live"]["requests"] > 20
    assert row["sim"]["requests"] == row["live"]["requests"]  # the same arrivals on both sides
    assert abs(row["compare"]["throughput"]["error"]) < 0.10  # far below capacity both keep up
    assert row["live_final_knobs"]["process_count"] == 1 and row["live_final_knobs"]["max_batch_size"] == 4
    assert "| poisson 10/s |" in proc.stdout
    assert (tmp_path / "out" / "validate.png").stat().st_size > 10_000 and (tmp_path / "out" / "validate.json").exists()
    serving = json.loads(cost_model.read_text())["serving"]  # the calibration, written into the cost model
    print(f"\ncalibration: {serving}")
    assert 0.0005 < serving["request_overhead_seconds"] < 0.1
    assert 0.0 < serving["front_cpu_seconds_per_request"] < 0.05
    assert 0.5 < serving["model_time_factor"] < 3.0
    spread = serving["model_time_percentiles"]  # the distribution the simulator draws batch times from
    assert len(spread) == 101 and spread == sorted(spread) and spread[0] <= serving["model_time_factor"] <= spread[100]
    assert math.isclose(serving["request_overhead_percentiles"][50], serving["request_overhead_seconds"])
    assert result["rows"][0]["sim"]["latency_seconds"]["p50"] > serving["request_overhead_seconds"]


def test_validate_rejects_a_bad_workload():
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", "validate", "--workload", "poisson:rate=x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "selftune validate:" in proc.stderr
