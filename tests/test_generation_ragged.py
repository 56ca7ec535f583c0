"""One model call per step (engine/ragged.py): the running rows' decode, whole prompts and a chunk
of a long one go through the model together, each part attending over its own cache, and no
stream changes a token for it; a model whose attention is not sdpa keeps one call per part."""

from __future__ import annotations

import torch
from test_generation import EOS, PROMPTS, drain, gpt2, greedy, llama, model, reference, tokens  # noqa: F401  (fixtures)
from transformers import AutoModelForCausalLM

from engine import ragged
from engine.generation import GenerationRunner, SequenceRequest

MAX_TOKENS = 16
LONG = tuple(range(100, 140))
ALL = {**PROMPTS, 99: LONG}


def _schedule():
    """Sequences that arrive while others decode: short prompts that join whole, and a long one
    (40 tokens) that a chunk of 8 spreads over five steps."""
    requests = [SequenceRequest(i, p, greedy(MAX_TOKENS)) for i, p in PROMPTS.items()]
    long = SequenceRequest(99, LONG, greedy(MAX_TOKENS))
    return {0: requests[:2], 3: [long], 4: requests[2:4], 9: requests[4:]}


def _count_calls(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


def _run(model, chunk=8):
    runner = GenerationRunner(model, [EOS], max_running=8, prefill_chunk=chunk)
    calls, handle = _count_calls(model)
    per_step, mixed, made = [], [], {}

    def check(step, r, outs):
        per_step.append(len(calls))
        calls.clear()
        firsts = [o for o in outs if o.seq_id not in made]
        made.update((o.seq_id, True) for o in outs)
        # a step that decoded running rows and prefilled: a first token, or a chunk that was not the last
        mixed.append(len(outs) > len(firsts) and (bool(firsts) or r.prefilling))

    try:
        got = drain(runner, _schedule(), check=check)
    finally:
        handle.remove()
    return runner, got, per_step, mixed


def test_a_step_that_decodes_and_prefills_is_one_model_call_with_the_same_tokens(model):
    runner, got, per_step, mixed = _run(model)
    assert runner._fused
    assert set(per_step) == {1}, per_step  # never a second call, however many parts a step has
    assert sum(mixed) >= 3  # steps that prefilled beside running rows, the long prompt's chunks included
    for seq_id, prompt in ALL.items():
        assert tokens(got[seq_id]) == reference(model, prompt, MAX_TOKENS), seq_id


def test_a_model_on_eager_attention_keeps_one_call_per_part_and_the_same_tokens(gpt2, tmp_path):
    gpt2.save_pretrained(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert not ragged.enable(eager) and eager.config._attn_implementation == "eager"
    runner, got, per_step, _ = _run(eager)
    assert not runner._fused and max(per_step) >= 2  # a decode and a prefill: two calls
    for seq_id, prompt in ALL.items():
        assert tokens(got[seq_id]) == reference(eager, prompt, MAX_TOKENS), seq_id


def test_a_switched_model_answers_plain_calls_as_sdpa_did(llama):
    """Other users of the model (a padded `generate`, the profiler) see transformers' sdpa."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    llama.set_attn_implementation("sdpa")
    with torch.inference_mode():
        before = llama(input_ids=ids, attention_mask=mask).logits
        assert ragged.enable(llama)
        after = llama(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_a_chunk_attends_over_its_earlier_chunks_and_itself_only():
    mask = ragged.causal_after(past=3, queries=2, device="cpu")
    assert mask.shape == (1, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert ragged.causal_after(past=0, queries=4, device="cpu") is None  # plain causal


def test_half_precision_attention_is_computed_in_fp32_on_a_cpu(llama):
    """torch's CPU attention kernel is slow in bf16 on decode queries: the parts (and plain calls)
    run it on fp32 copies and cast the result back; fp32 inputs go through untouched."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = llama.model.layers[0].self_attn  # 4 query heads over 2 key/value heads
    torch.manual_seed(0)
    q = torch.randn(3, 4, 1, 16, dtype=torch.bfloat16)
    k, v = torch.randn(3, 2, 10, 16, dtype=torch.bfloat16), torch.randn(3, 2, 10, 16, dtype=torch.bfloat16)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # a left-padded row
    out, _ = ragged._sdpa(module, q, k, v, mask)
    want, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    additive = torch.zeros(3, 1, 1, 10, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))  # a float mask is upcast with them
    assert torch.equal(ragged._sdpa(module, q, k, v, additive)[0], out)
    plain, _ = ragged._sdpa(module, q.float(), k.float(), v.float(), mask)
    assert plain.dtype == torch.float32 and torch.equal(plain, want)


def test_a_prefill_only_step_does_not_copy_the_lm_head_weight(llama):
    """A step with one prompt and no running rows is a plain call; its last column reaches the LM
    head as a row torch's matmul folds to 2-D. Sliced (logits_to_keep=1) from a [1, n, hidden]
    prompt, bf16 ran the head as a bmm over a copy of its whole weight, on every such step."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    bf16 = copy.deepcopy(llama).to(torch.bfloat16).requires_grad_(False)  # as engine.loading loads it: matmul folds differently with grad
    weight = bf16.lm_head.weight.numel()
    runner = GenerationRunner(bf16, [EOS], max_running=4)
    runner.add(SequenceRequest(0, LONG, greedy(2)))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        outputs = runner.step()
    assert [o.seq_id for o in outputs] == [0]  # the prompt's first token, from that one call
    copies = [e for e in prof.events() if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0]
              and torch.Size(e.input_shapes[0]).numel() == weight]
    assert not copies, f"the LM head's weight ({weight} values) was copied in a prefill-only step"


def test_step_sizes_are_a_bounded_set_of_at_most_an_eighth_more_tokens():
    sizes = [ragged.padded_tokens(t) for t in range(1, 2049)]
    assert sizes[:16] == list(range(1, 17))  # decode steps of a few rows run as they are
    assert all(t <= s <= 1.125 * t for t, s in zip(range(1, 2049), sizes))
    assert sizes == sorted(sizes) and len(set(sizes)) == 72  # against 2,048 shapes a kernel may be compiled for
    assert all(ragged.padded_tokens(s) == s for s in set(sizes))


def test_a_bf16_runner_steps_at_padded_sizes_with_the_same_tokens(llama):
    """In half precision on a CPU every step's call has one of padded_tokens' sizes (the padding
    is a part of its own: no cache keeps it, no logits come from it), and each stream's tokens
    are those of the same runner stepping at the exact sizes."""
    import copy

    bf16 = copy.deepcopy(llama).to(torch.bfloat16).requires_grad_(False)
    sizes = []
    handle = bf16.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]), with_kwargs=True)

    def run(padded):
        runner = GenerationRunner(bf16, [EOS], max_running=8, prefill_chunk=25)
        runner._padded = padded
        sizes.clear()
        return drain(runner, _schedule()), list(sizes)

    try:
        exact, exact_sizes = run(False)
        padded, padded_sizes = run(True)
    finally:
        handle.remove()
    assert any(ragged.padded_tokens(s) != s for s in exact_sizes), exact_sizes  # the schedule has sizes that pad
    assert all(ragged.padded_tokens(s) == s for s in padded_sizes)
    assert {seq: tokens(out) for seq, out in padded.items()} == {seq: tokens(out) for seq, out in exact.items()}
    assert GenerationRunner(bf16, [EOS])._padded and not GenerationRunner(llama, [EOS])._padded  # fp32 runs as it is
