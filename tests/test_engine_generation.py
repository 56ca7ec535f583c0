"""Generation through the engine: real worker processes, continuous batching, a saved tiny GPT-2."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import wait_until
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, Knobs
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.jobs import TokenEvent, WorkerLost

PROMPTS = [[101, 7592, 2088], [101, 1996, 4248, 2829, 4419, 14523, 2058], [101, 2054], [101] + list(range(2000, 2030))]


@pytest.fixture(scope="module")
def engine(tiny_causal_lm):
    # fp32, as the reference it is compared with (dtype auto may pick bf16 on a CPU with native bf16)
    config = EngineConfig(model=tiny_causal_lm, task="generate", dtype="float32", knobs=Knobs(process_count=1, max_batch_size=3))
    with Engine(config) as eng:
        yield eng


def reference_tokens(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_continuous_batching_matches_generate_for_each_prompt_alone(engine, tiny_causal_lm):
    """More prompts than max_batch_size, different lengths: each equals model.generate alone."""
    lengths = [12, 5, 20, 9]
    streams = [engine.generate(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, lengths)]
    got = [[event.token_id for event in stream] for stream in streams]
    for prompt, n, tokens in zip(PROMPTS, lengths, got):
        expected = reference_tokens(tiny_causal_lm, prompt, n)
        assert tokens == expected[: len(tokens)]
        assert len(tokens) == n or tokens[-1] in engine.info.eos_token_ids


def test_cancel_stops_a_running_generation(engine):
    stream = engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.8, seed=1))
    first = stream.get(timeout=30)
    assert isinstance(first, TokenEvent)
    assert engine.cancel(stream.request_id)
    wait_until(lambda: engine.stats().workers[0].load == 0)
    assert engine.stats().pending_requests == 0


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    a = [e.token_id for e in engine.generate(PROMPTS[1], params)]
    b = [e.token_id for e in engine.generate(PROMPTS[1], params)]
    assert a == b


def test_worker_death_fails_started_generation_with_typed_error(engine):
    stream = engine.generate(PROMPTS[2], SamplingParams(max_tokens=250, temperature=0))
    assert isinstance(stream.get(timeout=30), TokenEvent)
    pid = engine.stats().workers[0].pid
    os.kill(pid, signal.SIGSTOP)  # freeze it mid-generation, so the kill cannot come too late
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerLost):
        for _ in stream:
            pass
    engine.wait_ready(timeout=60)
    tokens = [e.token_id for e in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))]
    assert len(tokens) == 4
