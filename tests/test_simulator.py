"""The simulator: known queueing results, the same batches as the engine's batcher, scaling under
a policy, the Azure trace, and the tuner's oracle on a synthetic cost model."""

from __future__ import annotations

from pathlib import Path

import math

import pytest

from autotune.offline.costmodel import DeterministicCostModel, FittedCostModel
from autotune.offline.simulator import SimConfig, Simulation, simulate
from autotune.offline.tuner import Problem, oracle, tune_policy, write_policy
from autotune.bench.workloads import poisson, step, trace
from engine.batcher import Batcher, Item
from engine.config import Knobs
from policies.loader import load_policy, policy_from_spec

COST_MODEL = "configs/costmodels/epyc-2core-minilm.json"
# The first 120 s of the Azure LLM conversation trace, byte for byte (tests/fixtures/README.md).
AZURE_EXCERPT = str(Path(__file__).resolve().parent / "fixtures" / "traces" / "azure_llm_conv_2023_first120s.csv")
# The whole hour, byte for byte (tests/fixtures/README.md).
AZURE = Path(__file__).resolve().parent / "fixtures" / "traces" / "azure_llm_conv_2023.csv"


def single_server() -> dict:
    """One worker, batches of one, and max_inflight_batches=1 so the router hands a worker one
    batch at a time: the queue in front of the batcher is a single FIFO server (M/D/1). With the
    engine's default of 2 in flight, the second batch would leave the queue early and wait at
    the worker instead, which is not the quantity the formula describes."""
    return dict(
        knobs=Knobs(process_count=1, max_batch_size=1, batch_timeout=0.0),
        max_inflight_batches=1,
        startup_seconds=0.0,
        max_queued_requests=10**9,
    )


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait_matches_the_formula(rho):
    service = 0.01
    rate = rho / service
    arrivals = poisson(rate, 200_000 / rate, length=16, seed=0)
    result = simulate(arrivals, DeterministicCostModel(service), SimConfig(**single_server()))
    waits = result.dispatched - result.arrival
    expected = rho / (2 * (1 / service) * (1 - rho))  # Wq = ρ / (2μ(1 − ρ))
    assert waits.mean() == pytest.approx(expected, rel=0.05)
    assert not result.rejected.any()


def test_serving_costs_outside_the_workers_add_latency_and_stretch_batches():
    arrivals = poisson(50, 200, length=16, seed=1)
    two = dict(knobs=Knobs(process_count=2, max_batch_size=1, batch_timeout=0.0), startup_seconds=0.0, cores=2)
    base = simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two))
    overhead = simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two, request_overhead_seconds=0.005))
    ok = ~base.rejected
    assert ((overhead.done - overhead.arrival)[ok] - (base.done - base.arrival)[ok]) == pytest.approx(0.005)
    # a serving worker 1.5 × slower than the profile: every batch of one takes 30 ms instead of 20
    slower = simulate(poisson(0.5, 200, length=16, seed=1), DeterministicCostModel(0.02), SimConfig(**two, model_time_factor=1.5))
    assert (slower.done - slower.arrival).max() == pytest.approx(0.03, rel=0.01)
    loaded = simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two, model_time_factor=1.5))
    assert loaded.summary()["latency_seconds"]["p99"] > 1.2 * base.summary()["latency_seconds"]["p99"]


def test_measured_spreads_are_drawn_from_seeded():
    arrivals = poisson(60, 200, length=16, seed=2)
    two = dict(knobs=Knobs(process_count=2, max_batch_size=1, batch_timeout=0.0), startup_seconds=0.0, cores=2)
    fixed = simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two, model_time_factor=1.2, request_overhead_seconds=0.004))
    flat = simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two, model_time_percentiles=(1.2,) * 101, request_overhead_percentiles=(0.004,) * 101))
    assert flat.done == pytest.approx(fixed.done)  # a distribution of one value is the fixed factor
    # the same median, a tail as live batch times have it: percentile q of the factor 1 + 0.4·(q/100)^8
    spread = tuple(1.0 + 0.4 * (q / 100) ** 8 for q in range(101))
    drawn = [simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two, model_time_percentiles=spread, seed=seed)) for seed in (0, 0, 1)]
    assert drawn[0].done == pytest.approx(drawn[1].done)  # the seed decides every draw
    assert drawn[0].done != pytest.approx(drawn[2].done)
    median = simulate(arrivals, DeterministicCostModel(0.02), SimConfig(**two, model_time_factor=spread[50]))
    assert drawn[0].summary()["latency_seconds"]["p99"] > 1.1 * median.summary()["latency_seconds"]["p99"]
    with pytest.raises(ValueError, match="model_time_percentiles"):
        SimConfig(model_time_percentiles=(1.0, 0.9) + (1.0,) * 99)


def test_a_cost_model_with_a_bad_spread_is_refused_with_its_file_and_key(tmp_path):
    import json
    import subprocess
    import sys

    model = json.loads(Path(__file__).parent.parent.joinpath(COST_MODEL).read_text())
    model["serving"]["model_time_percentiles"] = [1.0, 2.0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(model))
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "simulate", "--workload", "poisson:rate=5,duration=10", "--cost-model", str(bad)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 2
    assert f"{bad}: serving.model_time_percentiles: expected 101" in proc.stderr


def test_the_simulated_sampler_reports_the_mean_time_of_one_batch():
    arrivals = poisson(40, 30, length=16, seed=3)
    config = SimConfig(knobs=Knobs(process_count=2, max_batch_size=8, batch_timeout=0.01), startup_seconds=0.0, cores=2)
    sim = Simulation(arrivals, DeterministicCostModel(0.02), config, load_policy(str(Path(__file__).resolve().parents[1] / "configs" / "policies" / "static.yaml")))
    result = sim.run()
    load = sim.sampler.sample(result.end_time + 0.5).load
    assert load.batch_size > 1.0  # several sizes of batch, each of which takes 20 ms
    assert load.batch_seconds == pytest.approx(0.02)
    sums = load.batch_times
    assert sums.seconds == pytest.approx(0.02 * sums.batches)
    assert sums.item_seconds == pytest.approx(0.02 * sums.items)
    assert sums.items_squared > sums.items  # some batches held more than one item


def reference_batches(arrivals, max_batch_size: int, timeout: float) -> list[tuple[tuple[int, ...], float]]:
    """engine.batcher.Batcher driven directly, as the live core does when a worker always has room:
    after each arrival, and whenever the next batch falls due, pop what is due."""
    batcher = Batcher(max_batch_size, timeout)
    out = []

    def pop_due(now):
        while (batch := batcher.pop_batch(now)) is not None:
            out.append((tuple(i.request_id for i in batch.items), batch.formed_at))

    for request_id, (t, length) in enumerate(arrivals):
        while (due := batcher.next_due()) is not None and due < t:
            pop_due(due)
        batcher.add(Item(request_id, 0, length, t))
        pop_due(t)
    while (due := batcher.next_due()) is not None:
        pop_due(due)
    return out


def test_simulated_batches_equal_the_engine_batcher():
    # a full batch at once, a remainder that times out, singles that time out, a second burst
    arrivals = [(0.000, 10), (0.001, 200), (0.002, 12), (0.003, 90), (0.004, 11), (0.005, 300),
                (0.050, 64), (0.100, 16), (0.1005, 17), (0.200, 5), (0.201, 500), (0.202, 6),
                (0.203, 7), (0.2031, 8), (0.2032, 9), (0.2033, 10), (0.2034, 11), (0.2035, 12)]
    config = SimConfig(knobs=Knobs(process_count=2, max_batch_size=4, batch_timeout=0.01), max_inflight_batches=1000, startup_seconds=0.0)
    sim = Simulation(arrivals, DeterministicCostModel(0.001), config)
    seen = []
    schedule = sim.scheduler.schedule

    def recording(now):
        dispatches = schedule(now)
        seen.extend((tuple(i.request_id for i in d.batch.items), d.batch.formed_at) for d in dispatches)
        return dispatches

    sim.scheduler.schedule = recording
    sim.run()
    expected = reference_batches(arrivals, 4, 0.01)
    assert seen == expected
    sizes = [len(ids) for ids, _ in expected]
    assert 4 in sizes and 1 in sizes  # both full batches and timed-out ones were made


def test_step_workload_scales_process_count_up_and_down():
    arrivals = step([(5, 60), (40, 120), (5, 240)], length=16, seed=3)
    policy = policy_from_spec({"kind": "threshold", "metric": "busy_fraction", "target": 0.7, "scale_down_stabilization_seconds": 30}, "test")
    config = SimConfig(knobs=Knobs(process_count=1, max_batch_size=1, batch_timeout=0.0), cores=4)
    result = simulate(arrivals, DeterministicCostModel(0.04), config, policy)
    counts = [k.process_count for _, k in result.knob_changes]
    peak = max(counts)
    assert peak >= 2
    up_at = next(t for t, k in result.knob_changes if k.process_count == peak)
    assert 60 <= up_at <= 180
    assert counts[-1] == 1
    back_at = next(t for t, k in result.knob_changes if t > up_at and k.process_count == 1)
    assert back_at > 180  # back to one worker only once the load has dropped
    summary = result.summary()
    assert summary["completed"] == len(arrivals)
    # every change is in the audit, with the holds between them (recorded once per reason)
    outcomes = [d["outcome"] for d in summary["decisions"]]
    assert outcomes.count("applied") == summary["changes"] and set(outcomes) == {"applied", "no-change"}


def test_azure_trace_excerpt_loads_with_its_count_span_clipping_and_speed():
    arrivals = trace(AZURE_EXCERPT)
    assert len(arrivals) == 456
    times = [t for t, _ in arrivals]
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] == pytest.approx(119.9, abs=0.1)
    # the excerpt holds prompts of 4,107 tokens: clipped to MiniLM's 512; none below 1
    assert max(n for _, n in arrivals) == 512 and min(n for _, n in arrivals) >= 1
    assert max(n for _, n in trace(AZURE_EXCERPT, max_tokens=100_000)) == 4107
    faster = trace(AZURE_EXCERPT, speed=2.0)
    assert faster[-1][0] == pytest.approx(times[-1] / 2)
    part = trace(AZURE_EXCERPT, start=60, duration=30)
    assert 0 < len(part) < len(arrivals) and part[0][0] >= 0 and part[-1][0] < 30


def test_azure_trace_loads_with_its_count_and_span():
    arrivals = trace(str(AZURE))
    assert len(arrivals) == 19_366
    times = [t for t, _ in arrivals]
    assert times[-1] == pytest.approx(3501.7, abs=0.1)
    assert arrivals[: len(trace(AZURE_EXCERPT))] == trace(AZURE_EXCERPT)


def synthetic_problem(objective: str) -> Problem:
    # 20 ms per batch plus 10 µs per token, perfect thread scaling, no contention below the cores
    cost = FittedCostModel(a=0.02, b=1e-5, c=0.0, f=1.0, s=0.0, k=1.0, o=0.0)
    return Problem(
        spec={"kind": "static"},
        workloads=[poisson(120, 30, length=16, seed=1)],
        cost_model=cost,
        sim=SimConfig(knobs=Knobs(), cores=2, slo_seconds=0.5),
        objective=objective,
    )


def test_oracle_finds_the_known_best_static_knobs():
    # 120 req/s: batches of 1 cap at <= 99/s on 2 cores (overload); batches of 8 serve it on
    # one core, so the cheapest configuration meeting the SLO is 1 process × 1 thread × 8.
    grid = {"process_count": [1, 2], "threads_per_process": [1, 2], "max_batch_size": [1, 8], "batch_timeout": [0.005]}
    best = oracle(synthetic_problem("cost_per_request"), grid)
    assert best["knobs"]["process_count"] == 1
    assert best["knobs"]["threads_per_process"] == 1
    assert best["knobs"]["max_batch_size"] == 8
    assert len(best["grid"]) == 6  # 2 × 2 processes × threads would oversubscribe 2 cores: skipped
    assert best["metrics"]["slo_attainment"] > 0.99


def test_tuned_policy_file_loads_unchanged(tmp_path):
    problem = synthetic_problem("goodput")
    problem.spec = {"kind": "threshold", "target": 0.7}
    problem.space = {"target": [0.5, 0.9], "max_step_up": [1, 2]}
    tuned = tune_policy(problem, method="grid")
    assert tuned["evaluations"] == 4
    assert tuned["score"] >= tuned["baseline_score"]
    path = tmp_path / "threshold-tuned.yaml"
    write_policy(tuned["spec"], str(path), "tuned in a test")
    policy = load_policy(str(path))
    assert policy.kind == "threshold"
    assert math.isclose(policy.params.target, tuned["spec"]["target"])


def test_simulate_cli_prints_json_last_and_writes_the_plot(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "simulate", "--workload", "step:schedule=5x20+60x20+5x20,length=16-64",
         "--policy", "configs/policies/default.yaml", "--knobs", "process_count=1,max_batch_size=4", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["requests"] > 1000 and result["throughput"] > 0
    assert result["knob_trajectory"][0]["max_batch_size"] == 4
    assert (tmp_path / "simulation.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "simulation.json").read_text())["requests"] == result["requests"]
    # the dashboard's page with the run inside: one point per simulated second, the knobs the run had
    import re

    page = (tmp_path / "report.html").read_text()
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert data["info"]["mode"] == "report" and len(data["points"]) >= 60
    assert data["points"][0]["knobs"]["max_batch_size"] == 4
    assert sum(p["arrival_rate"] for p in data["points"]) == pytest.approx(result["requests"], rel=0.01)
    assert len(data["decisions"]) == len(result["decisions"]) and data["decisions"], "the policy changed nothing: the report shows no decision"
