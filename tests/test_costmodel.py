"""The cost model: the fit recovers known coefficients, and a model survives a JSON round trip."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from autotune.offline.costmodel import COEFFICIENTS, DeterministicCostModel, FittedCostModel, Point, fit_cost_model, load_cost_model, predict

KNOWN = FittedCostModel(a=0.006, b=2.3e-4, c=2e-7, f=0.85, s=0.4, k=0.3, o=0.35)


def synthetic_points(noise: float = 0.0, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    points = []
    for B, L, T, P in itertools.product((1, 4, 16), (16, 64, 256), (1, 2), (1, 2)):
        t = predict(KNOWN.coefficients(), np.array([B], float), np.array([L], float), np.array([T], float), np.array([P], float), 2.0)[0]
        points.append(Point(B, L, T, P, float(t * (1 + noise * rng.standard_normal()))))
    return points


def test_fit_recovers_known_coefficients():
    model = fit_cost_model(synthetic_points(), cores=2)
    for name in COEFFICIENTS:
        assert getattr(model, name) == pytest.approx(getattr(KNOWN, name), rel=0.02), name
    assert model.fit["heldout_mape"] < 1e-3


def test_fit_with_noise_reports_a_heldout_error_near_the_noise():
    model = fit_cost_model(synthetic_points(noise=0.05, seed=1), cores=2)
    assert 0.005 < model.fit["heldout_mape"] < 0.15
    assert model.fit["heldout_points"] + model.fit["train_points"] == 36


def test_json_round_trip(tmp_path):
    model = fit_cost_model(synthetic_points(), cores=2, machine={"cpu": "test", "cores": 2})
    path = tmp_path / "model.json"
    model.save(str(path))
    loaded = load_cost_model(str(path))
    assert np.allclose(loaded.coefficients(), model.coefficients())
    assert loaded.machine == {"cpu": "test", "cores": 2}
    assert loaded.fit == model.fit
    assert loaded.service_time(8, 128, 1, 2, 2) == pytest.approx(model.service_time(8, 128, 1, 2, 2))


def test_service_time_grows_with_work_and_contention():
    m = KNOWN
    assert m.service_time(8, 64, 1, 1, 2) < m.service_time(16, 64, 1, 1, 2) < m.service_time(16, 128, 1, 1, 2)
    assert m.service_time(16, 64, 2, 1, 2) < m.service_time(16, 64, 1, 1, 2)  # threads help
    assert m.service_time(16, 64, 1, 1, 2) < m.service_time(16, 64, 1, 2, 2)  # a busy neighbour hurts
    assert m.service_time(16, 64, 2, 2, 2) > m.service_time(16, 64, 2, 1, 2) * 1.5  # oversubscribed


def test_deterministic_model_is_constant():
    model = DeterministicCostModel(0.25)
    assert model.service_time(1, 16, 1, 1, 2) == model.service_time(64, 512, 4, 3, 2) == 0.25


def test_shipped_cost_model_loads():
    model = load_cost_model(str(Path(__file__).resolve().parents[1] / "configs" / "costmodels" / "epyc-2core-minilm.json"))
    assert model.machine["cores"] >= 1 and model.fit["heldout_points"] > 0
    assert 0 < model.service_time(16, 16, 1, 1, model.machine["cores"]) < 1.0


# ---- the backend and dtype a cost model was measured with (#21) ------------------------------


def test_the_backend_survives_a_round_trip_and_old_files_read_it_from_the_machine(tmp_path):
    import dataclasses
    import json

    model = dataclasses.replace(fit_cost_model(synthetic_points(), cores=2, machine={"dtype": "float32"}),
                                backend={"name": "torch", "dtype": "bfloat16", "mode": "bf16-mixed", "requested": "auto"})
    model.save(str(tmp_path / "m.json"))
    assert load_cost_model(str(tmp_path / "m.json")).backend == model.backend
    old = {k: v for k, v in model.to_json().items() if k != "backend"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_cost_model(str(tmp_path / "old.json")).backend == {"name": "torch", "dtype": "float32"}


def test_a_cost_model_of_another_dtype_than_the_server_serves_is_an_error_or_a_warning():
    from autotune.offline.costmodel import check_dtype

    fp32 = FittedCostModel(a=0.01, b=1e-4, c=1e-7, backend={"dtype": "float32", "requested": "float32"})
    bf16 = FittedCostModel(a=0.01, b=1e-4, c=1e-7, backend={"dtype": "bfloat16", "requested": "bfloat16"})
    assert check_dtype(fp32, "float32", None) is None and check_dtype(bf16, "bfloat16", None) is None
    with pytest.raises(ValueError, match=r"cost model X was measured with dtype float32, but model.dtype is bfloat16: profile with `selftune profile --dtype bfloat16`"):
        check_dtype(fp32, "bfloat16", None, "cost model X")
    assert check_dtype(fp32, "auto", (False, "no avx512_bf16")) is None  # auto without native bf16 serves fp32
    with pytest.raises(ValueError, match="auto serves float32 on this CPU"):
        check_dtype(bf16, "auto", (False, "no avx512_bf16"))
    assert "measured in float32, but model.dtype auto serves bfloat16" in check_dtype(fp32, "auto", (True, "avx512_bf16"))
    assert check_dtype(bf16, "auto", (True, "avx512_bf16")) is None
    assert check_dtype(FittedCostModel(0.01, 1e-4, 1e-7, backend={"dtype": "float32", "requested": "auto"}), "auto", (True, "x")) is None
    assert "does not say" in check_dtype(FittedCostModel(0.01, 1e-4, 1e-7), "float32", None)
    with pytest.raises(ValueError, match="model.dtype: 'int8'"):
        check_dtype(fp32, "int8", None)


def test_the_shipped_cost_model_states_its_dtype():
    model = load_cost_model(str(Path(__file__).resolve().parents[1] / "configs" / "costmodels" / "epyc-2core-minilm.json"))
    assert model.backend["name"] == "torch" and model.backend["dtype"] == model.machine["dtype"] == "float32"


def test_simulate_refuses_a_cost_model_of_another_dtype_and_warns_for_auto():
    import os
    import subprocess
    import sys

    def simulate(*extra, native="1"):
        env = {**os.environ, "SELFTUNE_NATIVE_BF16": native}
        return subprocess.run([sys.executable, "-m", "autotune.cli", "simulate", "--workload", "poisson:rate=5,duration=5", *extra],
                              capture_output=True, text=True, timeout=120, env=env)

    fp32_model = ("--cost-model", "builtin:epyc-2core-minilm")
    wrong = simulate("--dtype", "bfloat16", *fp32_model)
    assert wrong.returncode == 2
    assert "cost model builtin:epyc-2core-minilm was measured with dtype float32, but model.dtype is bfloat16" in wrong.stderr
    right = simulate("--dtype", "float32", *fp32_model)
    assert right.returncode == 0 and "warning" not in right.stderr
    auto = simulate(*fp32_model)
    assert auto.returncode == 0 and "warning: cost model builtin:epyc-2core-minilm was measured in float32, but model.dtype auto serves bfloat16" in auto.stderr
    # Without --cost-model, the shipped one for what the server would serve: no warning either way.
    for extra, native, want in ((("--dtype", "float32"), "1", "epyc-2core-minilm"), ((), "1", "epyc-2core-minilm-bf16"),
                                (("--dtype", "bfloat16"), "0", "epyc-2core-minilm-bf16"), ((), "0", "epyc-2core-minilm")):
        done = simulate(*extra, "--json", native=native)
        assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
        assert json.loads(done.stdout.splitlines()[-1])["cost_model"] == f"builtin:{want}"


def test_a_profile_runs_and_records_the_dtype_the_server_would_serve():
    from conftest import minilm_dir

    from autotune.offline.profiler import Grid, profile

    model = profile(minilm_dir(), "bfloat16", Grid((1, 4), (16, 32), (1,), (1,), (), 0.05, 1))
    assert model.backend["dtype"] == model.machine["dtype"] == "bfloat16" and model.backend["mode"] == "bf16-mixed"
    assert model.backend["requested"] == "bfloat16" and model.backend["min_cosine"] >= 0.9999 and len(model.points) == 4
