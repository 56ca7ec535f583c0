"""The simulator learns generation: its worker makes the live runner's batch decisions (the same
engine.gen_admission code, checked step by step against the real runner on a tiny model), the
cost model fits the real runner's steps, and whole runs obey the knobs, the KV cap and a policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_generation import gpt2, greedy  # noqa: F401  (fixtures)

from autotune.offline.gen_costmodel import GenCostModel, auto_batch_tokens, load_gen_cost_model
from autotune.offline.gen_simulator import GenSimConfig, GenWorker, _Seq, simulate_generation
from autotune.offline.gen_workload import generation_arrivals
from engine.config import Knobs
from engine.generation import GenerationRunner, SequenceRequest
from policies.generate import GeneratePolicy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "tests", "fixtures", "traces", "azure_llm_conv_2023_first120s.csv")
COST = GenCostModel({1: ((0.01, 1e-4, 1e-7), (0.02, 0.002, 2e-6)), 2: ((0.006, 6e-5, 6e-8), (0.012, 0.0012, 1.2e-6))}, 2048, 18432)
"""A hand-made model of a small LM on 2 cores: 20 ms + 2 ms a row (+ attention) per decode step."""

REQUESTS = [(0, 12, 40), (1, 3, 40), (2, 30, 30), (3, 7, 40), (4, 45, 10), (5, 2, 45), (6, 18, 30)]
"""(id, prompt tokens, tokens to make)."""


@pytest.mark.parametrize("max_running, chunk, kv", [(4, None, None), (3, 8, None), (6, 16, 100), (6, None, 160)])
def test_the_simulated_worker_decides_every_step_as_the_live_runner(gpt2, max_running, chunk, kv):
    runner = GenerationRunner(gpt2, [], max_running=max_running, kv_tokens=kv, prefill_chunk=chunk, kv_ceiling=1000)
    worker = GenWorker(0)
    arrive = {0: REQUESTS[:4], 3: REQUESTS[4:6], 7: REQUESTS[6:]}
    for step in range(200):
        for seq_id, prompt, n in arrive.pop(step, []):
            runner.add(SequenceRequest(seq_id, tuple(range(10, 10 + prompt)), greedy(n, ignore_eos=True)))
            worker.waiting.append(_Seq(seq_id, prompt, n, seq_id))
        if not runner.has_work and not arrive:
            break
        live = sorted(o.seq_id for o in runner.step())
        simulated = worker.step(max_running, chunk, kv)
        assert sorted(s.request_id for s in simulated.emitted) == live, f"step {step}"
        assert (worker.kv_used(), worker.preemptions) == (runner.kv_tokens_used, runner.preemptions), f"step {step}"
        assert (len(worker.rows) + (worker.partial is not None), len(worker.waiting)) == (runner.num_running, runner.num_waiting)
    assert not worker.has_work and not runner.has_work
    if kv is not None:
        assert runner.preemptions > 0  # the cap was what held it back


def test_trace_lengths_are_clipped_to_the_models_context():
    arrivals = generation_arrivals(f"trace:path={TRACE},duration=60", max_positions=256)
    assert arrivals and all(p >= 1 and n >= 1 and p + n <= 256 for _, p, n in arrivals)
    assert [t for t, _, _ in arrivals] == sorted(t for t, _, _ in arrivals)
    assert len(generation_arrivals(f"trace:path={TRACE},duration=60,speed=2", 256)) == len(arrivals)
    poisson = generation_arrivals("poisson:rate=2,duration=10,length=100,output=32", 2048)
    assert poisson and all((p, n) == (100, 32) for _, p, n in poisson)


def test_a_run_finishes_every_request_with_its_tokens_and_the_kv_cap_preempts():
    arrivals = [(0.1 * i, 200 + 10 * i, 120) for i in range(30)]
    roomy = simulate_generation(arrivals, COST, GenSimConfig(knobs=Knobs(process_count=1, threads_per_process=2, max_batch_size=16)))
    tight = simulate_generation(arrivals, COST, GenSimConfig(knobs=Knobs(process_count=1, threads_per_process=2, max_batch_size=16, kv_tokens=1500)))
    for result in (roomy, tight):
        s = result.summary()
        assert s["completed"] == 30 and result.output_tokens == 30 * 120
    assert roomy.summary()["preemptions"] == 0 and tight.summary()["preemptions"] > 0
    assert simulate_generation(arrivals, COST, GenSimConfig(knobs=Knobs(process_count=1, threads_per_process=2))).summary() == roomy.summary()


def test_the_generate_policy_drives_the_simulated_engine_and_changes_knobs():
    arrivals = generation_arrivals(f"trace:path={TRACE},duration=120,speed=4", 2048)
    start = Knobs(process_count=2, threads_per_process=1, max_batch_size=4, max_batch_tokens=1024)
    config = GenSimConfig(knobs=start)
    static = simulate_generation(arrivals, COST, config).summary()
    tuned = simulate_generation(arrivals, COST, config, GeneratePolicy()).summary()
    assert static["completed"] == tuned["completed"] == len(arrivals)
    assert tuned["changes"] > 0 and tuned["decide_calls"] > 0
    applied = [d for d in tuned["decisions"] if d["outcome"] == "applied"]
    assert applied and all("ttft_p99_seconds" in d["observation"] or "itl_p99_seconds" in d["observation"] for d in applied)


def test_a_queue_limit_sheds_the_overload_and_the_rest_meets_ttft():
    """Twice and four times what one worker keeps up with: queued without a limit, nearly every
    request misses TTFT; with `queue_timeout` short of the TTFT objective by a prefill's time, the
    late ones are refused unrun and the rest are on time. At the objective itself, a served
    request has waited nearly all of it: shedding alone does not make it good."""
    knobs = Knobs(process_count=1, threads_per_process=2, max_batch_size=8)
    for gap in (0.1, 0.05):
        arrivals = [(gap * i, 100, 60) for i in range(400)]
        waits, at_objective, short = (simulate_generation(arrivals, COST, GenSimConfig(knobs=knobs, queue_timeout=t)).summary()
                                      for t in (None, 2.0, 1.5))
        assert waits["shed"] == waits["rejected"] == 0 and waits["completed"] == 400
        assert short["shed"] == short["rejected"] > 0 and short["completed"] + short["shed"] == 400
        assert short["ttft_seconds"]["p99"] < 2.0 < waits["ttft_seconds"]["p50"]
        assert short["goodput"] > 3 * waits["goodput"] and short["goodput"] > at_objective["goodput"]
    # The served requests' TTFT p99 stays under the objective; the requests refused tell the policy
    # that capacity is short, and it grows the batch.
    tuned = simulate_generation(arrivals, COST, GenSimConfig(knobs=knobs, queue_timeout=1.5), GeneratePolicy()).summary()
    grew = [d for d in tuned["decisions"] if d["outcome"] == "applied" and "refused; TTFT over" in d["reason"]]
    assert grew and grew[0]["observation"]["ttft_p99_seconds"] < 2.0
    assert tuned["goodput"] > short["goodput"]


def _cli(*args, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_simulate_and_tune_run_for_generate_on_a_trace(tmp_path):
    cost = tmp_path / "gen-cost.json"
    COST.save(str(cost))
    assert load_gen_cost_model(str(cost)).by_threads == COST.by_threads
    workload = f"trace:path={TRACE},duration=60,speed=2"
    result = _cli("simulate", "--task", "generate", "--workload", workload, "--cost-model", str(cost),
                  "--policy", "builtin:generate", "--knobs", "process_count=1,threads_per_process=2,max_batch_size=4,max_batch_tokens=auto", "--json")
    assert result["task"] == "generate" and result["completed"] == result["requests"] > 10
    assert result["knob_trajectory"][0]["max_batch_size"] == 4 and result["ttft_seconds"]["p99"] > 0
    # auto: the chunk the live probe would pick on the profiled machine, per thread × 2 threads
    assert result["knob_trajectory"][0]["max_batch_tokens"] == 2 * auto_batch_tokens(COST)["per_thread"]
    assert result["dtype"] == "float32"
    # a cost model measured in fp32 does not simulate a server forced to bf16
    wrong = subprocess.run([sys.executable, "-m", "autotune.cli", "simulate", "--task", "generate", "--workload", workload, "--cost-model", str(cost),
                            "--dtype", "bfloat16"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "was measured with dtype float32, but model.dtype is bfloat16" in wrong.stderr
    config = tmp_path / "tune.yaml"
    config.write_text(json.dumps({
        "task": "generate", "policy": "builtin:generate", "cost_model": str(cost), "out": str(tmp_path / "out"),
        "workloads": [workload], "simulator": {"cores": 2},
        "search": {"method": "grid", "params": {"growth_step": [2, 8]}},
        "static_grid": {"process_count": [1], "threads_per_process": [2], "max_batch_size": [2, 16], "max_batch_tokens": [256]},
    }))
    tuned = _cli("tune", "--config", str(config), "--json")
    assert tuned["evaluations"] == 2 and tuned["score"] >= tuned["baseline_score"]
    assert tuned["oracle"]["knobs"]["max_batch_size"] in (2, 16) and (tmp_path / "out" / "generate-tuned.yaml").is_file()


def test_profiling_the_real_runner_gives_a_cost_model_per_thread_count(tiny_causal_lm, tmp_path):
    from autotune.offline.gen_profiler import profile_generation

    grid = {"threads": (1, 2), "prefill": (8, 32), "rows": (1, 4), "columns": (16, 48), "repeats": 2}
    model = profile_generation(tiny_causal_lm, grid)
    assert sorted(model.by_threads) == [1, 2] and model.max_positions == 256 and model.kv_values_per_token == 2 * 2 * 64
    assert len(model.points) == 2 * (2 + 2 * 2) and all(s > 0 for *_, s in model.points)
    assert all(c >= 0 for p, d in model.by_threads.values() for c in (*p, *d))
    path = tmp_path / "tiny.json"
    model.save(str(path))
    assert load_gen_cost_model(str(path)).by_threads == model.by_threads
    # profiled in what `model.dtype: auto` serves here, and it says so
    assert model.choice["requested"] == "auto" and model.dtype == model.choice["dtype"] and load_gen_cost_model(str(path)).dtype == model.dtype
    with pytest.raises(ValueError, match="not a generation cost model"):
        load_gen_cost_model(os.path.join(ROOT, "configs", "costmodels", "epyc-2core-minilm.json"))



def test_the_shipped_generation_cost_models_say_their_dtype():
    from autotune import shipped
    from autotune.offline.gen_cli import DEFAULT_GEN_COST_MODELS

    for dtype, spec in DEFAULT_GEN_COST_MODELS.items():
        model = load_gen_cost_model(str(shipped.resolve(spec, shipped.COST_MODEL)))
        assert model.dtype == dtype and sorted(model.by_threads) == [1, 2]


def test_a_step_that_prefills_beside_the_decode_pays_for_one_model_call():
    prefill, decode = COST.step_seconds(32, 0, 0, 1), COST.step_seconds(0, 4, 100, 1)
    both = COST.step_seconds(32, 4, 100, 1)
    assert both == pytest.approx(prefill + decode - 0.01)  # the smaller fixed part (p0) counted once
