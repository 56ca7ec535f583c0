"""The generation knobs live: running sequences (max_batch_size), prompt tokens per step
(max_batch_tokens) and KV tokens per worker (kv_tokens) change while sequences run, in the runner
and through a real engine's workers, and no stream loses or changes a token."""

from __future__ import annotations

import pytest
from helpers import wait_until
from test_engine_generation import PROMPTS as ENGINE_PROMPTS
from test_engine_generation import reference_tokens
from test_generation import EOS, PROMPTS, drain, gpt2, greedy, llama, model, reference, tokens  # noqa: F401  (fixtures)

from engine.config import Bounds, EngineConfig, KnobError, Knobs, kv_cap
from engine.engine import Engine
from engine.generation import GenerationRunner, SequenceRequest
from engine.sampling import SamplingParams

MAX_TOKENS = 24


def test_the_kv_knob_caps_below_the_ceiling_and_zero_means_all_of_it():
    assert kv_cap(0, 1000) == 1000 and kv_cap(300, 1000) == 300 and kv_cap(5000, 1000) == 1000
    assert kv_cap(0, None) is None and kv_cap(64, None) == 64


def test_bounds_hold_the_generation_knobs():
    with pytest.raises(KnobError, match=r"max_batch_tokens=-1 is outside"):
        Bounds().validate(Knobs(max_batch_tokens=-1))
    with pytest.raises(KnobError, match=r"kv_tokens=100 is outside the allowed range \[200, 400\]"):
        Bounds(kv_tokens=(200, 400)).validate(Knobs(kv_tokens=100))


def test_lowering_the_kv_cap_mid_run_preempts_and_changes_no_token(model):
    runner = GenerationRunner(model, [EOS], max_running=6, kv_tokens=1000)
    caps = []

    def check(step, r, outs):
        if step == 4:
            r.kv_tokens = 64  # six rows of ~20 columns hold ~120 slots: some must go
        if step > 4:
            caps.append(r.kv_tokens_used)

    got = drain(runner, {0: [SequenceRequest(i, p, greedy(MAX_TOKENS)) for i, p in PROMPTS.items()]}, check=check)
    for seq_id, prompt in PROMPTS.items():
        assert tokens(got[seq_id]) == reference(model, prompt, MAX_TOKENS), seq_id
    assert runner.preemptions > 0 and max(caps[1:]) <= 64


def test_a_cap_below_one_sequence_runs_it_alone_instead_of_failing(gpt2):
    runner = GenerationRunner(gpt2, [EOS], max_running=4, kv_tokens=None, kv_ceiling=200)
    runner.add(SequenceRequest(1, tuple(range(10, 30)), greedy(30)))  # 50 slots alone
    runner.step()
    runner.kv_tokens = 16  # lower than that one sequence needs: it goes on, alone
    runner.add(SequenceRequest(2, (5, 6), greedy(3)))  # still checked against the ceiling, not the cap
    got = drain(runner)
    assert len(got[1]) == 29 and len(got[2]) == 3


def test_the_prefill_chunk_changes_mid_prompt(gpt2):
    runner = GenerationRunner(gpt2, [EOS], max_running=4, prefill_chunk=4)
    runner.add(SequenceRequest(0, (5, 6), greedy(40)))
    runner.step()  # 0 decodes from now on, so the budget binds
    prompt = tuple(range(100, 140))
    runner.add(SequenceRequest(1, prompt, greedy(6)))
    assert [o.seq_id for o in runner.step() + runner.step()] == [0, 0]  # two chunks of 4 of 40
    runner.prefill_chunk = None  # whole prompts now: the rest goes in one step
    first = [o for o in runner.step() if o.seq_id == 1]
    got = first + drain(runner)[1]
    assert len(first) == 1 and tokens(got) == reference(gpt2, prompt, 6)


@pytest.fixture(scope="module")
def engine(tiny_causal_lm):
    config = EngineConfig(model=tiny_causal_lm, task="generate", dtype="float32", knobs=Knobs(process_count=1, max_batch_size=4))  # as the reference
    with Engine(config) as eng:
        yield eng


def test_knobs_change_live_on_a_running_engine_without_breaking_a_stream(engine, tiny_causal_lm):
    """Mid-stream: fewer running sequences, a small KV cap and small prefill chunks reach the worker
    (its /stats figures and its preemptions show it), and every stream still equals generate alone."""
    max_tokens = 200
    streams = [engine.generate(p, SamplingParams(max_tokens=max_tokens, temperature=0)) for p in ENGINE_PROMPTS]
    first = streams[0].get(timeout=30)  # streaming has begun
    engine.apply(engine.knobs.replace(max_batch_size=2, kv_tokens=256, max_batch_tokens=8))
    got = [[first.token_id] + [e.token_id for e in streams[0]]] + [[e.token_id for e in s] for s in streams[1:]]
    for prompt, ids in zip(ENGINE_PROMPTS, got):
        assert ids == reference_tokens(tiny_causal_lm, prompt, max_tokens)[: len(ids)]
        assert len(ids) == max_tokens or ids[-1] in engine.info.eos_token_ids
    list(engine.generate(ENGINE_PROMPTS[1], SamplingParams(max_tokens=2, temperature=0)))  # one more step reports
    (worker,) = engine.stats().workers
    assert (worker.max_running_sequences, worker.kv_tokens_total, worker.max_batch_tokens) == (2, 256, 8)
    assert worker.preemptions > 0  # rows of ~200 columns: a 256-slot cap holds one at a time
    assert engine.stats().knobs.kv_tokens == 256
    with pytest.raises(KnobError, match="max_batch_tokens"):
        engine.apply(engine.knobs.replace(max_batch_tokens=-1))
    engine.apply(engine.knobs.replace(max_batch_size=4, kv_tokens=0, max_batch_tokens=256))
    list(engine.generate(ENGINE_PROMPTS[1], SamplingParams(max_tokens=2, temperature=0)))
    (worker,) = engine.stats().workers
    assert worker.kv_tokens_total == engine.info.kv_tokens and worker.max_batch_tokens == 256  # 0: the whole ceiling


def test_the_config_sets_the_generation_knobs_and_their_bounds(tmp_path):
    from autotune.settings import load_config

    path = tmp_path / "gen.yaml"
    path.write_text("concurrency:\n  max_batch_tokens: 64\n  kv_tokens: 4096\nbounds:\n  kv_tokens: {min: 1024, max: 8192}\n")
    config = load_config(path).engine_config()
    assert (config.knobs.max_batch_tokens, config.knobs.kv_tokens, config.bounds.kv_tokens) == (64, 4096, (1024, 8192))


def test_a_generating_engines_observations_carry_ttft_itl_and_the_workers_sequences(engine):
    from autotune.controller import ControllerConfig, DecisionLoop
    from autotune.telemetry import Telemetry
    from policies.generate import GeneratePolicy

    telemetry = Telemetry(engine, window=60.0)
    telemetry.sample_now()
    for prompt in ENGINE_PROMPTS:
        list(engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0)))
    observation = telemetry.sample_now()
    ttft, itl, tpot = (observation.load.latency[stage] for stage in ("ttft", "itl", "tpot"))
    assert ttft.count == len(ENGINE_PROMPTS) and itl.count >= 19 * len(ENGINE_PROMPTS) and 0 < itl.p99 and 0 < ttft.p99
    # one time per output token per finished request: its mean gap, so within the gaps' range
    assert tpot.count == len(ENGINE_PROMPTS) and itl.p50 * 0.5 <= tpot.p50 <= itl.p99 * 1.1
    (worker,) = observation.workers
    assert worker.kv_tokens_total == engine.info.kv_tokens and worker.running_sequences == 0
    entry = DecisionLoop(GeneratePolicy(), engine.config.bounds, ControllerConfig()).entry(observation, engine.knobs, None, None, "x", "y")
    assert entry["observation"]["itl_p99_seconds"] == round(itl.p99, 5) and entry["observation"]["preemptions"] == 0


def test_while_a_worker_drains_the_kept_one_takes_its_cores_only_after(tiny_causal_lm):
    """2 × 1 -> 1 × 2 with sequences running in both: the drained worker finishes its own on its
    own CPU, and the kept worker grows onto both cores only once it has gone (growing at once
    put three OpenMP threads on two cores and stalled every stream)."""
    from test_placement_live import allowed_cpus

    from engine.placement import affinity_topology, plan_placement

    if len(affinity_topology().cpus) < 2:
        pytest.skip("needs two CPUs")
    config = EngineConfig(model=tiny_causal_lm, task="generate", knobs=Knobs(process_count=2, threads_per_process=1, max_batch_size=4))
    with Engine(config) as eng:
        eng.wait_ready(workers=2)
        params = SamplingParams(max_tokens=230, temperature=0, ignore_eos=True)
        streams = [eng.generate(ENGINE_PROMPTS[i % 3], params) for i in range(8)]
        for stream in streams:
            stream.get(timeout=30)  # every worker is decoding
        before = {w.worker_id: allowed_cpus(w.pid) for w in eng.stats().workers}
        eng.apply(eng.knobs.replace(process_count=1, threads_per_process=2))
        wait_until(lambda: any(w.state == "draining" for w in eng.stats().workers))
        (kept,) = [w for w in eng.stats().workers if w.state != "draining"]
        seen = []
        while True:
            cpus = allowed_cpus(kept.pid)  # read before the stats that show the other one still there
            if len(eng.stats().workers) == 1:
                break
            seen.append(cpus)
        assert seen and all(cpus == before[kept.worker_id] for cpus in seen), seen
        want = set(plan_placement(affinity_topology(), 1, 2).workers[0].cpus)
        wait_until(lambda: allowed_cpus(kept.pid) == want)
        for stream in streams:
            assert len(list(stream)) == 229  # nothing lost in the move
