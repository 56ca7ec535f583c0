"""The KV cap and chunked prefill: a generation worker's cache never holds more token slots than
it may (sequences wait or are preempted and recomputed instead), a long prompt is prefilled a
chunk per step while the running rows keep decoding, and no stream changes a token for either."""

from __future__ import annotations

import dataclasses

import pytest
from test_generation import EOS, PROMPTS, drain, gpt2, greedy, llama, model, reference, tokens  # noqa: F401  (fixtures)

from engine.config import EngineConfig, Knobs, kv_token_slots
from engine.engine import Engine
from engine.generation import KV_RESERVE, GenerationRunner, SequenceRequest
from engine.jobs import InputTooLong
from engine.sampling import SamplingParams

MAX_TOKENS = 24


def test_a_small_cache_preempts_and_recomputes_without_changing_a_token(model):
    cap = 64  # the longest prompt (13) + 24 tokens fits alone; six sequences at once do not
    runner = GenerationRunner(model, [EOS], max_running=6, kv_tokens=cap)
    peak = []

    def check(step, r, outs):
        peak.append(r.kv_tokens_used)
        assert r.kv_tokens_used <= cap, f"step {step}: {r.kv_tokens_used} slots held, cap {cap}"

    got = drain(runner, {0: [SequenceRequest(i, p, greedy(MAX_TOKENS)) for i, p in PROMPTS.items()]}, check=check)
    for seq_id, prompt in PROMPTS.items():
        assert tokens(got[seq_id]) == reference(model, prompt, MAX_TOKENS), seq_id
    assert runner.preemptions > 0 and max(peak) > cap // 2  # the cap was what held it back


@pytest.mark.parametrize("cap", [None, 64])
def test_chunked_prefill_gives_the_same_tokens(model, cap):
    runner = GenerationRunner(model, [EOS], max_running=6, kv_tokens=cap, prefill_chunk=4)
    requests = [SequenceRequest(i, p, greedy(MAX_TOKENS)) for i, p in PROMPTS.items()]
    chunked = []  # the first decodes from step 1, so the others are prefilled 4 tokens a step beside it

    def check(step, r, outs):
        chunked.append(r.prefilling)
        assert cap is None or r.kv_tokens_used <= cap

    got = drain(runner, {0: requests[:1], 1: requests[1:]}, check=check)
    assert cap is not None or any(chunked)  # (with the cap, admissions wait for room instead)
    for seq_id, prompt in PROMPTS.items():
        assert tokens(got[seq_id]) == reference(model, prompt, MAX_TOKENS), seq_id


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_long_prompt_does_not_stall_the_running_decodes(gpt2, chunk):
    runner = GenerationRunner(gpt2, [EOS], max_running=4, prefill_chunk=chunk)
    runner.add(SequenceRequest(1, (5, 6), greedy(40)))
    runner.step()  # 1 is running
    runner.add(SequenceRequest(2, tuple(range(100, 140)), greedy(4)))
    steps = 0
    while True:
        steps += 1
        produced = {o.seq_id for o in runner.step()}
        assert 1 in produced  # the running sequence makes a token every step
        if 2 in produced:
            break
    assert steps == (1 if chunk is None else 40 // chunk)  # chunked: one step per 4 prompt tokens


def test_a_long_prompt_with_nothing_decoding_is_prefilled_in_one_step(gpt2):
    runner = GenerationRunner(gpt2, [EOS], max_running=4, prefill_chunk=4)
    runner.add(SequenceRequest(2, tuple(range(100, 140)), greedy(4)))
    assert [o.seq_id for o in runner.step()] == [2] and not runner.prefilling  # 40 tokens, chunk 4: one step
    runner.add(SequenceRequest(3, tuple(range(100, 140)), greedy(4)))
    assert [o.seq_id for o in runner.step()] == [2] and runner.prefilling  # 2 decodes now: 3 goes in chunks


def test_without_a_cap_nothing_is_preempted(gpt2):
    runner = GenerationRunner(gpt2, [EOS], max_running=6)
    drain(runner, {0: [SequenceRequest(i, p, greedy(MAX_TOKENS)) for i, p in PROMPTS.items()]})
    assert runner.preemptions == 0 and runner.kv_tokens_used == 0  # idle: the cache is gone


def test_admission_waits_for_room_and_keeps_the_queue_order(gpt2):
    long_prompt = tuple(range(10, 50))
    runner = GenerationRunner(gpt2, [EOS], max_running=4, kv_tokens=2 * (len(long_prompt) + KV_RESERVE) - 1)
    runner.add(SequenceRequest(1, long_prompt, greedy(8)))
    runner.add(SequenceRequest(2, long_prompt, greedy(8)))
    runner.add(SequenceRequest(3, (5, 6), greedy(8)))
    runner.step()
    assert (runner.num_running, runner.num_waiting) == (1, 2)  # 2 does not fit beside 1, and 3 does not overtake it


def test_a_sequence_that_could_never_fit_is_refused(gpt2):
    runner = GenerationRunner(gpt2, [EOS], kv_tokens=16)
    with pytest.raises(ValueError, match="KV cache"):
        runner.add(SequenceRequest(1, tuple(range(10, 20)), greedy(8)))


def test_slots_follow_the_memory_and_the_dtype():
    assert kv_token_slots(1, 1024, "float32") == 256 and kv_token_slots(1, 1024, "bfloat16") == 512
    assert kv_token_slots(1024, 0, "float32") is None  # unknown layout: no cap


def test_the_engine_sizes_the_cache_refuses_what_cannot_fit_and_shows_it(tiny_causal_lm):
    config = EngineConfig(model=tiny_causal_lm, task="generate", kv_cache_mib=1, knobs=Knobs(process_count=1, max_batch_size=3))
    with Engine(config) as eng:
        slots = eng.info.kv_tokens
        assert slots == kv_token_slots(1, eng.info.kv_values_per_token, eng.dtype) and slots > 0
        list(eng.generate([101, 7592, 2088], SamplingParams(max_tokens=4, temperature=0.0)))
        (worker,) = eng.stats().workers
        assert worker.kv_tokens_total == slots and worker.preemptions == 0
        eng.info = dataclasses.replace(eng.info, kv_tokens=8)  # as if the cache were tiny
        with pytest.raises(InputTooLong, match="kv_cache_mib"):
            eng.generate([101, 7592, 2088], SamplingParams(max_tokens=6))
