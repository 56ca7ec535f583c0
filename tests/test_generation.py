"""Tests for engine.generation: continuous batching against HF `generate`, on real tiny models.

The models are built from configs with a fixed seed, saved and reloaded through
`AutoModelForCausalLM.from_pretrained` (the loading path the server uses), in float32.
GPT-2 exercises learned absolute positions, Llama exercises RoPE; both must see correct
per-row `position_ids` and padding masks or greedy outputs drift from the reference.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from engine.generation import GenerationRunner, SamplingParams, SequenceRequest, TokenOutput

VOCAB = 1000
EOS = 3  # the models' EOS; a random tiny model rarely emits it, and references handle it if it does
PAD = 0

PROMPTS = {
    0: (5, 17, 256, 42, 99, 7, 300),
    1: (11, 12),
    2: (400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412),
    3: (999, 1, 500, 600),
    4: (77,),
    5: (123, 321, 213, 132, 231),
}


def _build(tmp_path_factory, name, config):
    # initializer_range=0.3 (not the default 0.02) gives peaked logits: greedy output varies
    # from token to token instead of repeating one id, so a wrong position or mask shows up,
    # and near-ties that float noise could flip are unlikely.
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return loaded.eval()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=256,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.3,
    )
    return _build(tmp_path_factory, "gpt2", config)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.3,
    )
    return _build(tmp_path_factory, "llama", config)


@pytest.fixture(params=["gpt2", "llama"])
def model(request):
    return request.getfixturevalue(request.param)


def reference(model, prompt, max_new_tokens):
    """Greedy tokens from HF generate for one prompt alone (stops after EOS, like the runner)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
        )
    tokens = out[0, len(prompt):].tolist()
    if EOS in tokens:  # generate pads finished rows; for one row it simply stops, but be exact
        tokens = tokens[: tokens.index(EOS) + 1]
    return tokens


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def drain(runner, schedule=None, max_steps=500, check=None):
    """Step until idle; `schedule` maps step index -> requests to add before that step.

    Returns {seq_id: [TokenOutput, ...]} and asserts no output follows a finish.
    """
    schedule = dict(schedule or {})
    got: dict[int, list[TokenOutput]] = {}
    for step in range(max_steps):
        for req in schedule.pop(step, []):
            runner.add(req)
        if not runner.has_work and not schedule:
            return got
        outs = runner.step()
        seen = [o.seq_id for o in outs]
        assert len(seen) == len(set(seen)), "a sequence produced two tokens in one step"
        for o in outs:
            prev = got.setdefault(o.seq_id, [])
            assert not prev or prev[-1].finish_reason is None, f"seq {o.seq_id} produced after finishing"
            prev.append(o)
        if check is not None:
            check(step, runner, outs)
    raise AssertionError("runner did not finish")


def tokens(outs):
    return [o.token_id for o in outs]


def test_greedy_continuous_batching_matches_generate(model):
    max_tokens = {0: 20, 1: 9, 2: 14, 3: 25, 4: 6, 5: 12}
    schedule = {
        0: [SequenceRequest(0, PROMPTS[0], greedy(max_tokens[0]))],
        3: [SequenceRequest(1, PROMPTS[1], greedy(max_tokens[1])),
            SequenceRequest(2, PROMPTS[2], greedy(max_tokens[2]))],
        7: [SequenceRequest(3, PROMPTS[3], greedy(max_tokens[3]))],
        8: [SequenceRequest(4, PROMPTS[4], greedy(max_tokens[4]))],
        15: [SequenceRequest(5, PROMPTS[5], greedy(max_tokens[5]))],
    }
    runner = GenerationRunner(model, eos_token_ids=[EOS], max_running=8)
    got = drain(runner, schedule)
    assert sorted(got) == list(PROMPTS)
    for seq_id, prompt in PROMPTS.items():
        ref = reference(model, prompt, max_tokens[seq_id])
        assert tokens(got[seq_id]) == ref, f"seq {seq_id} diverged from generate"
        expected = "stop" if ref[-1] == EOS else "length"
        assert got[seq_id][-1].finish_reason == expected
        assert all(o.finish_reason is None for o in got[seq_id][:-1])
    assert not runner.has_work and runner.num_running == 0 and runner.num_waiting == 0


def test_batched_prefill_of_different_lengths_matches_generate(gpt2):
    # All added before the first step: one left-padded prefill batch, then decode together.
    runner = GenerationRunner(gpt2, eos_token_ids=[EOS], max_running=16)
    got = drain(runner, {0: [SequenceRequest(i, p, greedy(10)) for i, p in PROMPTS.items()]})
    for seq_id, prompt in PROMPTS.items():
        assert tokens(got[seq_id]) == reference(gpt2, prompt, 10)


def test_max_running_caps_batch_and_admits_when_slots_free(gpt2):
    lengths = {0: 3, 1: 8, 2: 5, 3: 2, 4: 6}
    runner = GenerationRunner(gpt2, eos_token_ids=(), max_running=2)
    for i, n in lengths.items():
        runner.add(SequenceRequest(i, PROMPTS[i], greedy(n)))
    assert runner.num_waiting == 5 and runner.num_running == 0

    history = []

    def check(step, r, outs):
        assert r.num_running <= 2
        history.append((r.num_running, r.num_waiting))

    got = drain(runner, check=check)
    assert history[0] == (2, 3)
    assert any(w < 3 for _, w in history), "waiting sequences were never admitted"
    for i, n in lengths.items():
        assert len(got[i]) == n and got[i][-1].finish_reason == "length"
        # Joining a batch that is mid-flight must not change the result.
        assert tokens(got[i]) == reference(gpt2, PROMPTS[i], n)


def test_shrinking_max_running_evicts_nothing(gpt2):
    runner = GenerationRunner(gpt2, eos_token_ids=(), max_running=4)
    for i in range(4):
        runner.add(SequenceRequest(i, PROMPTS[i], greedy(4 + 2 * i)))
    first = {o.seq_id: [o] for o in runner.step()}
    assert runner.num_running == 4 and sorted(first) == [0, 1, 2, 3]
    runner.max_running = 1
    runner.add(SequenceRequest(4, PROMPTS[4], greedy(3)))
    runner.add(SequenceRequest(5, PROMPTS[5], greedy(3)))

    history = []

    def check(step, r, outs):
        history.append((r.num_running, r.num_waiting, {o.seq_id for o in outs}))

    got = drain(runner, check=check)
    # The four running sequences all completed; nobody new joined while they ran.
    for i in range(4):
        assert len(first[i] + got[i]) == 4 + 2 * i
        assert tokens(first[i] + got[i]) == reference(gpt2, PROMPTS[i], 4 + 2 * i)
    first_admit = next(k for k, (_, _, ids) in enumerate(history) if ids & {4, 5})
    before = [4] + [n for n, _, _ in history[:first_admit]]
    assert all(a >= b for a, b in zip(before, before[1:])), "running count grew after shrinking"
    assert before[-1] == 0, "a new sequence was admitted while old ones still filled the batch"
    assert all(n <= 1 for n, _, _ in history[first_admit:])
    assert got[4][0].finish_reason is None and len(got[4]) == 3 and len(got[5]) == 3
    with pytest.raises(ValueError):
        runner.max_running = 0


def _sample_run(model, requests, companions=()):
    runner = GenerationRunner(model, eos_token_ids=(), max_running=8)
    got = drain(runner, {0: list(requests), 2: list(companions)})
    return {i: tokens(v) for i, v in got.items()}


def test_seeded_sampling_is_independent_of_batch(model):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=42)
    alone = _sample_run(model, [SequenceRequest(0, PROMPTS[0], params)])[0]
    crowd = [
        SequenceRequest(1, PROMPTS[1], SamplingParams(max_tokens=6, temperature=1.3, seed=7)),
        SequenceRequest(2, PROMPTS[2], greedy(9)),
        SequenceRequest(3, PROMPTS[3], SamplingParams(max_tokens=15, temperature=1.0)),  # unseeded
    ]
    together = _sample_run(model, [SequenceRequest(0, PROMPTS[0], params), crowd[0]], crowd[1:])[0]
    assert together == alone
    assert len(alone) == 12

    other_seeds = [
        _sample_run(model, [SequenceRequest(0, PROMPTS[0], SamplingParams(12, 0.9, 0.95, seed=s))])[0]
        for s in (43, 44)
    ]
    assert any(o != alone for o in other_seeds), "different seeds gave identical samples"


def test_tiny_top_p_is_greedy(gpt2):
    prompt = PROMPTS[2]
    sampled = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(10, 1.0, 1e-6, seed=3))])[0]
    assert sampled == reference(gpt2, prompt, 10)


def test_sampling_is_not_greedy_at_high_temperature(gpt2):
    # Guards against a sampler that silently ignores temperature and always takes the argmax.
    prompt = PROMPTS[0]
    sampled = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(12, 1.5, 1.0, seed=5))])[0]
    assert sampled != reference(gpt2, prompt, 12)


def test_abort_running_and_waiting(llama):
    runner = GenerationRunner(llama, eos_token_ids=(), max_running=2)
    for i in range(4):
        runner.add(SequenceRequest(i, PROMPTS[i], greedy(10)))
    first = runner.step()
    assert {o.seq_id for o in first} == {0, 1}
    assert runner.abort(0) is True  # running
    assert runner.abort(3) is True  # waiting
    assert runner.abort(0) is False and runner.abort(3) is False and runner.abort(99) is False
    assert runner.num_running == 1 and runner.num_waiting == 1

    got = drain(runner)
    assert 0 not in got and 3 not in got
    # The survivor's cache rows were index-selected correctly; the late joiner too.
    assert tokens(first[1:2]) + tokens(got[1]) == reference(llama, PROMPTS[1], 10)
    assert tokens(got[2]) == reference(llama, PROMPTS[2], 10)

    runner.add(SequenceRequest(7, PROMPTS[4], greedy(5)))
    assert runner.abort(7) is True and not runner.has_work
    assert runner.step() == []


def test_stop_tokens_finish_with_stop_and_max_tokens_with_length(gpt2):
    prompt = PROMPTS[3]
    ref = reference(gpt2, prompt, 12)
    assert EOS not in ref
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    stop = ref[k]

    runner = GenerationRunner(gpt2, eos_token_ids=[EOS], max_running=4)
    got = drain(runner, {0: [
        SequenceRequest(0, prompt, greedy(12, stop_token_ids=(stop,))),
        SequenceRequest(1, prompt, greedy(5)),
        SequenceRequest(2, prompt, greedy(1)),
    ]})
    assert tokens(got[0]) == ref[: k + 1]
    assert got[0][-1] == TokenOutput(0, stop, "stop")
    assert tokens(got[1]) == ref[:5] and got[1][-1].finish_reason == "length"
    assert [o.finish_reason for o in got[1][:-1]] == [None] * 4
    assert got[2] == [TokenOutput(2, ref[0], "length")]

    # The model's EOS ids (constructor) finish with "stop" the same way.
    runner = GenerationRunner(gpt2, eos_token_ids=[ref[0]], max_running=4)
    got = drain(runner, {0: [SequenceRequest(0, prompt, greedy(12))]})
    assert got[0] == [TokenOutput(0, ref[0], "stop")]


def test_rejects_bad_requests(gpt2):
    runner = GenerationRunner(gpt2, eos_token_ids=[EOS])
    runner.add(SequenceRequest(1, (5, 6), greedy(3)))
    with pytest.raises(ValueError):
        runner.add(SequenceRequest(1, (5, 6), greedy(3)))  # duplicate id
    with pytest.raises(ValueError):
        runner.add(SequenceRequest(2, (), greedy(3)))
    with pytest.raises(ValueError):
        runner.add(SequenceRequest(3, (5,) * 250, greedy(10)))  # beyond n_positions=256
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_temperature_scales_logits(gpt2):
    prompt = PROMPTS[5]
    cold = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(12, 1e-3, 1.0, seed=9))])[0]
    assert cold == reference(gpt2, prompt, 12)
    warm = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(12, 1.0, 1.0, seed=9))])[0]
    hot = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(12, 5.0, 1.0, seed=9))])[0]
    assert hot != warm, "same seed, different temperature gave identical samples"


def test_retiring_long_sequence_trims_cache_columns(gpt2):
    # Without trimming, the batch stays as wide as the longest sequence ever admitted and a
    # long-lived server's cache grows without bound. Reads private state on purpose.
    runner = GenerationRunner(gpt2, eos_token_ids=(), max_running=4)
    runner.add(SequenceRequest(0, PROMPTS[2], greedy(6)))  # 13-token prompt
    runner.add(SequenceRequest(1, PROMPTS[4], greedy(20)))  # 1-token prompt
    produced = 0
    while runner.num_running != 1 or runner.num_waiting:
        produced += sum(o.seq_id == 1 for o in runner.step())
    produced += sum(o.seq_id == 1 for o in runner.step())
    # The cache holds row 1's prompt plus every generated token except the newest (not yet fed).
    width = len(PROMPTS[4]) + produced - 1
    assert produced == 7
    assert runner._mask.shape == (1, width) and bool(runner._mask.all())
    assert all(layer.keys.shape[-2] == width for layer in runner._cache.layers)


# ---- the sampling parameters clients send (OpenAI's and vLLM's) ----------------------------


def penalized_reference(model, prompt, max_tokens, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding the slow, obvious way: the whole sequence through the model each step,
    OpenAI's presence/frequency penalties on the output and CTRL's repetition penalty on
    prompt + output applied to the last logits by hand."""
    ids = list(prompt)
    out = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
            for token in set(ids):
                if repetition != 1.0:
                    logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
            for token in set(out):
                logits[token] -= presence + frequency * out.count(token)
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token == EOS:
                break
    return out


@pytest.mark.parametrize("penalty", [{"presence": 1.5}, {"frequency": 0.7}, {"repetition": 1.8}, {"presence": -0.5, "frequency": 0.3, "repetition": 1.2}])
def test_penalties_match_the_formula_while_batched_with_others(model, penalty):
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    params = greedy(16, **{names[k]: v for k, v in penalty.items()})
    runner = GenerationRunner(model, eos_token_ids=[EOS], max_running=4)
    got = drain(runner, {0: [SequenceRequest(0, PROMPTS[0], params), SequenceRequest(1, PROMPTS[2], greedy(10))],
                         2: [SequenceRequest(2, PROMPTS[5], params)]})
    for seq_id, prompt in ((0, PROMPTS[0]), (2, PROMPTS[5])):
        assert tokens(got[seq_id]) == penalized_reference(model, prompt, 16, **penalty)
    assert tokens(got[1]) == reference(model, PROMPTS[2], 10)  # its neighbour is untouched
    assert tokens(got[0]) != reference(model, PROMPTS[0], 16), "the penalty changed nothing: the test proves nothing"


def test_min_tokens_ignore_eos_and_logit_bias(gpt2):
    eos_first = {"logit_bias": ((EOS, 100.0),)}  # EOS becomes the argmax at every step
    runner = GenerationRunner(gpt2, eos_token_ids=[EOS])
    got = drain(runner, {0: [
        SequenceRequest(0, PROMPTS[0], greedy(10, **eos_first)),
        SequenceRequest(1, PROMPTS[0], greedy(10, min_tokens=5, **eos_first)),
        SequenceRequest(2, PROMPTS[0], greedy(4, ignore_eos=True, **eos_first)),
        SequenceRequest(3, PROMPTS[0], greedy(10, ignore_eos=True, stop_token_ids=(EOS,), **eos_first)),
        SequenceRequest(4, PROMPTS[0], greedy(10, min_tokens=3, stop_token_ids=(77,), logit_bias=((77, 100.0),))),
    ]})
    assert tokens(got[0]) == [EOS] and got[0][-1].finish_reason == "stop"
    assert len(got[1]) == 6 and EOS not in tokens(got[1])[:5] and tokens(got[1])[5] == EOS and got[1][-1].finish_reason == "stop"
    assert tokens(got[2]) == [EOS] * 4 and got[2][-1].finish_reason == "length"  # past EOS to max_tokens
    assert tokens(got[3]) == [EOS] and got[3][-1].finish_reason == "stop"  # a stop token still stops
    assert len(got[4]) == 4 and 77 not in tokens(got[4])[:3] and tokens(got[4])[3] == 77


def test_logprobs_are_the_models_log_softmax_with_the_top_alternatives(gpt2):
    prompt = PROMPTS[5]
    runner = GenerationRunner(gpt2, eos_token_ids=[EOS])
    got = drain(runner, {0: [SequenceRequest(0, prompt, greedy(6, logprobs=3, frequency_penalty=2.0)),
                             SequenceRequest(1, prompt, greedy(6))]})
    ids = list(prompt)
    with torch.inference_mode():
        for out in got[0]:
            expected = torch.log_softmax(gpt2(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            assert out.logprobs.logprob == pytest.approx(float(expected[out.token_id]), abs=1e-4)
            top_ids, top_values = zip(*out.logprobs.top)
            assert list(top_ids) == expected.topk(3).indices.tolist()
            assert list(top_values) == pytest.approx(expected.topk(3).values.tolist(), abs=1e-4)
            ids.append(out.token_id)
    assert all(o.logprobs is None for o in got[1])


def test_top_k_one_is_greedy_and_top_k_narrows_the_samples(gpt2):
    prompt = PROMPTS[0]
    one = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(12, 1.5, 1.0, seed=4, top_k=1))])[0]
    assert one == reference(gpt2, prompt, 12)
    free = _sample_run(gpt2, [SequenceRequest(0, prompt, SamplingParams(12, 1.5, 1.0, seed=4))])[0]
    assert free != one, "sampling at temperature 1.5 gave the greedy tokens: the test proves nothing"


def test_sampling_params_reject_what_they_cannot_do():
    for bad in ({"top_k": -2}, {"min_tokens": 17}, {"repetition_penalty": 0.0}, {"presence_penalty": 2.5},
                {"frequency_penalty": -3.0}, {"logprobs": 21}, {"logit_bias": ((5, 101.0),)}, {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(ValueError):
            SamplingParams(max_tokens=16, **bad)


def test_the_generation_worker_refuses_an_unknown_message_out_loud_and_keeps_working(gpt2, caplog):
    import logging

    from engine import messages as m
    from engine.worker import GenerateWorker

    spec = m.WorkerSpec(worker_id=0, task="generate", device="cpu", threads=1, max_batch_size=4, slots=1, slot_items=4,
                        max_length=256, hidden_size=64, eos_token_ids=(EOS,), warmup=False)
    worker = GenerateWorker(spec, conn=None, model=gpt2)
    with caplog.at_level(logging.ERROR, logger="selftune.worker"):
        assert worker.handle(("not", "a", "message")) is False
    assert "refusing an unknown message tuple" in caplog.text
    worker.handle(m.AddSequence(7, PROMPTS[1], greedy(5)))
    got = drain(worker.runner)
    assert tokens(got[7]) == reference(gpt2, PROMPTS[1], 5)
    assert worker.handle(m.Stop()) is True
