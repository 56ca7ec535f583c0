"""The simulator's wandering machine speed (GenSimConfig.speed_noise, step_noise): off by default,
seeded, mean factor 1, correlated over its time constant, and wide enough to give requests of one
burst different paces, as this VM's live runs do."""

from __future__ import annotations

import math

import numpy as np
from test_gen_simulator import COST, _cli

from autotune.offline.gen_simulator import GenSimConfig, SpeedNoise, simulate_generation
from engine.config import Knobs

KNOBS = Knobs(process_count=2, threads_per_process=1, max_batch_size=16, max_batch_tokens=128)
ARRIVALS = [(0.25 * i, 150 + (37 * i) % 100, 40) for i in range(160)]


def test_the_factor_is_one_without_noise_and_repeats_with_its_seed():
    assert [SpeedNoise(0.0, 10.0, 0.0, 3).factor(t) for t in (0.0, 1.0, 50.0)] == [1.0, 1.0, 1.0]
    draws = [[SpeedNoise(0.1, 10.0, 0.1, seed).factor(t) for t in np.arange(0, 100, 0.5)] for seed in (7, 7, 8)]
    assert draws[0] == draws[1] != draws[2]


def test_the_factor_has_mean_one_and_is_correlated_over_its_time_constant():
    noise = SpeedNoise(0.2, 10.0, 0.0, 1)
    logs = np.log([noise.factor(t) for t in np.arange(0, 20000, 0.5)])
    assert abs(np.mean(np.exp(logs)) - 1) < 0.03 and abs(np.std(logs) - 0.2) < 0.03
    def lag_correlation(steps):
        return np.corrcoef(logs[:-steps], logs[steps:])[0, 1]
    assert abs(lag_correlation(2) - math.exp(-0.1)) < 0.05  # 1 s apart: exp(-1/10)
    assert abs(lag_correlation(200)) < 0.1  # 100 s apart: about none


def test_no_noise_is_the_noiseless_run_and_speed_noise_spreads_the_requests_paces():
    def run(**noise):
        return simulate_generation(ARRIVALS, COST, GenSimConfig(knobs=KNOBS, **noise))
    plain = run()
    assert run(speed_noise=0.0, step_noise=0.0, noise_seed=5).summary() == plain.summary()
    def spread(result):  # p90 / p10 of the requests' mean gaps
        gaps = result.mean_gap[~np.isnan(result.mean_gap)]
        return np.percentile(gaps, 90) / np.percentile(gaps, 10)
    noisy = run(speed_noise=0.1, speed_noise_seconds=10.0, noise_seed=5)
    assert noisy.summary()["completed"] == plain.summary()["completed"] == len(ARRIVALS)
    assert noisy.summary() != plain.summary() and spread(noisy) > spread(plain) + 0.05
    assert run(speed_noise=0.1, speed_noise_seconds=10.0, noise_seed=5).summary() == noisy.summary()


def test_simulate_takes_the_noise_from_its_command_line(tmp_path):
    cost = tmp_path / "gen-cost.json"
    COST.save(str(cost))
    args = ("simulate", "--task", "generate", "--workload", "poisson:rate=3,duration=40,length=200,output=40,seed=1", "--cost-model", str(cost),
            "--knobs", "process_count=2,threads_per_process=1,max_batch_size=16,max_batch_tokens=128", "--json")
    plain, noisy = _cli(*args), _cli(*args, "--speed-noise", "0.2", "--step-noise", "0.1", "--noise-seed", "3")
    assert plain["completed"] == noisy["completed"] == plain["requests"]
    assert noisy["itl_seconds"]["p99"] > plain["itl_seconds"]["p99"] and noisy["itl_seconds"] != plain["itl_seconds"]
