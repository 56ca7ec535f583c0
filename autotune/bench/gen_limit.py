"""The generation limit: batched decode flat out, in-process, with no server in the way.

Spawned children (the caller never imports torch) load the model in the dtype the server serves
(`served_choice`: the zygote's own choice for `model.dtype: auto`) and run the engine's
own `GenerationRunner`, as the two layouts that fill the cores do (1 process × all threads,
and one single-threaded process per core, the sequences split between them). At each total
batch B the new prompts are prefilled first (timed apart: prefill tokens/s), then all
children decode together for `duration` seconds; B grows, the running sequences are kept.
Output tokens/s per layout and B is the most a server could stream at that running batch.

Given the bench's (prompt, output) length pairs, each child then serves those requests in a
closed loop (`_serve_mix`): B sequences always running, a finished one replaced by the next
pair at once, whole prompts prefilled beside the decoding rows. Output tokens/s there is the
limit with prefill included: what the machine gives on the requests the server is sent, which
decode alone overstates when prompts are long against outputs.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import time

from autotune.bench.limit import child_setup

BATCH_SIZES = (1, 8, 16, 32)


def _grow_and_decode(runner, batch: int, prompt_tokens: int, max_tokens: int, vocab: int, duration: float, rng: random.Random, barrier) -> tuple[float, int, float]:
    """(prefill tokens/s, decoded tokens, seconds) with `batch` sequences running in this child:
    those still running from the smaller batch before are kept (32 after 16 prefills 16 prompts)."""
    new = batch - runner.num_running
    for _ in range(new):
        _add_random(runner, rng, prompt_tokens, max_tokens, vocab)
    started = time.perf_counter()
    runner.step()  # admits the new ones: one prefill (and one decode step of those already running)
    prefill = new * prompt_tokens / (time.perf_counter() - started)
    if barrier is not None:
        barrier.wait(timeout=600)  # every child decodes at once, as a server's workers would
    tokens, steps = 0, 0
    started = time.perf_counter()
    while runner.has_work and (steps < 3 or time.perf_counter() - started < duration):
        tokens += len(runner.step())
        steps += 1
    return prefill, tokens, time.perf_counter() - started


_ids = itertools.count()


def _add_random(runner, rng: random.Random, prompt_tokens: int, max_tokens: int, vocab: int) -> None:
    """Queue a sequence of `prompt_tokens` random ids (clear of the special tokens) that makes
    exactly `max_tokens` greedy tokens, whatever it draws."""
    from engine.generation import SequenceRequest
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runner.add(SequenceRequest(next(_ids), tuple(rng.randrange(100, vocab) for _ in range(prompt_tokens)), params))


def _serve_mix(runner, batches, pairs, vocab: int, duration: float, rng: random.Random, barrier) -> dict[int, tuple[int, float]]:
    """{B: (output tokens, seconds)} with B of `pairs`' requests always in the runner, at each B in turn.
    A window holds a few completions per running sequence at most (a 256-token prompt's prefill is a
    large step of its own), so it needs to be several times longer than the decode phase's.

    A sequence that joins when B grows is given a random part of its output length (the rest of
    a life already under way), so completions are spread out as in a steady state, not all at once."""
    cycle = itertools.cycle(pairs[rng.randrange(len(pairs)):] + pairs)

    def add(residual: bool) -> None:
        prompt, output = next(cycle)
        _add_random(runner, rng, prompt, rng.randint(1, output) if residual else output, vocab)

    runner.prefill_chunk = None  # flat out: whole prompts, the cheapest way through them
    out = {}
    for batch in batches:
        runner.max_running = batch
        while runner.num_running + runner.num_waiting < batch:
            add(residual=True)
        runner.step()  # the joining prompts' prefill, outside the timed window
        if barrier is not None:
            barrier.wait(timeout=600)
        tokens, started = 0, time.perf_counter()
        while time.perf_counter() - started < duration:
            while runner.num_running + runner.num_waiting < batch:
                add(residual=False)
            tokens += len(runner.step())
        out[batch] = (tokens, time.perf_counter() - started)
    return out


def _child(path: str, threads: int, batches, prompt_tokens: int, duration: float, barrier, results, rank: int, dtype: str = "float32",
           pairs=None, mix_duration: float = 0.0) -> None:
    try:
        torch = child_setup(threads)
        from engine.generation import GenerationRunner
        from engine.loading import load_model, load_tokenizer, model_info

        model = load_model(path, "generate", getattr(torch, dtype))
        info = model_info(path, load_tokenizer(path), "generate")
        prompt_tokens = max(1, min(prompt_tokens, info.max_length // 4))
        max_tokens = info.max_length - prompt_tokens  # room for as many decode steps as the context allows
        runner = GenerationRunner(model, info.eos_token_ids, max_running=max(batches))
        rng = random.Random(rank)
        _grow_and_decode(runner, 1, prompt_tokens, 4, info.vocab_size, 0.0, rng, None)  # warm-up at the prompt length: first calls are slow
        while runner.has_work:
            runner.step()
        out = {b: _grow_and_decode(runner, b, prompt_tokens, max_tokens, info.vocab_size, duration, rng, barrier) for b in batches}
        mix = {}
        if pairs:
            runner = GenerationRunner(model, info.eos_token_ids, max_running=max(batches))  # the decode phase's long sequences dropped
            mix = _serve_mix(runner, batches, pairs, info.vocab_size, mix_duration, rng, barrier)
        results.put((rank, {"prompt_tokens": prompt_tokens, "table": out, "mix": mix}))
    except BaseException as exc:  # report, never hang the parent
        if barrier is not None:
            barrier.abort()  # the others would wait for this one forever
        results.put((rank, {"error": repr(exc)}))


def run_layout(ctx, path: str, processes: int, threads: int, batch_sizes, prompt_tokens: int, duration: float,
               dtype: str = "float32", pairs=None, mix_duration: float = 0.0) -> dict:
    """{total B: tokens/s} of `processes` children × `threads`: "decode", "prefill" (prompt tokens/s)
    and, given `pairs`, "mix" (output tokens/s serving them); and the "prompt_tokens" decode ran with."""
    per_child = sorted({max(1, b // processes) for b in batch_sizes})
    barrier = ctx.Barrier(processes) if processes > 1 else None
    results = ctx.Queue()
    children = [ctx.Process(target=_child, args=(path, threads, per_child, prompt_tokens, duration, barrier, results, r, dtype, pairs, mix_duration))
                for r in range(processes)]
    for c in children:
        c.start()
    try:
        got = dict(results.get(timeout=900) for _ in children)
    finally:
        for c in children:
            c.join(timeout=60)
            if c.is_alive():
                c.kill()
    failed = [f"child {r}: {g['error']}" for r, g in got.items() if "error" in g]
    if failed:
        raise RuntimeError("generation limit failed: " + "; ".join(failed))
    return {"decode": {b * processes: sum(g["table"][b][1] / g["table"][b][2] for g in got.values()) for b in per_child},
            "prefill": {b * processes: sum(g["table"][b][0] for g in got.values()) for b in per_child},
            "mix": {b * processes: sum(g["mix"][b][0] / g["mix"][b][1] for g in got.values()) for b in per_child if pairs},
            "prompt_tokens": got[0]["prompt_tokens"]}


def measure_generation_limit(path: str, cores: int, prompt_tokens: int, batch_sizes=BATCH_SIZES, duration: float = 2.0, say=lambda msg: None,
                             dtype: str = "float32", pairs=None, mix_duration: float = 6.0) -> dict:
    """Decode tokens/s per layout and total batch size in `dtype`, the best cell, and prefill tokens/s;
    given the bench's (prompt, output) `pairs`, output tokens/s serving them ("with_prefill")."""
    ctx = mp.get_context("spawn")
    layouts = [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]
    table, prefill, mix = {}, {}, {}
    for processes, threads in layouts:
        name = f"{processes}x{threads}"
        got = run_layout(ctx, path, processes, threads, batch_sizes, prompt_tokens, duration, dtype, pairs, mix_duration)
        table[name], prefill[name], mix[name], used = got["decode"], got["prefill"], got["mix"], got["prompt_tokens"]
        say(f"limit {name}, prompts of {used} tokens: " + "  ".join(f"B={b}: {v:.0f} tok/s" for b, v in table[name].items()))
        if pairs:
            say(f"limit {name}, serving the requests (prefill included): " + "  ".join(f"B={b}: {v:.0f} tok/s" for b, v in mix[name].items()))
    name, batch = max(((n, b) for n in table for b in table[n]), key=lambda k: table[k[0]][k[1]])
    processes, threads = (int(x) for x in name.split("x"))
    return {"tokens_per_second": table[name][batch], "batch_size": batch, "processes": processes, "threads": threads, "dtype": dtype,
            "prompt_tokens": used, "table": table, "prefill_tokens_per_second": prefill, "with_prefill": mix if pairs else None}
