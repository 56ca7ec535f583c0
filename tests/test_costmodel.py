"""The cost model: the fit recovers known coefficients, and a model survives a JSON round trip."""

from __future__ import annotations

import itertools
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
