"""`max_batch_tokens: auto` for generation on a CPU: the prompt chunk a step can prefill, measured.

How many prompt tokens fit beside the running rows in one step depends on the CPU and the dtype
(a prompt token costs several times more in fp32 than in bf16 on AMX), so a constant sized on
one machine is wrong on the next. The probe (run in the zygote's probe child, on one thread, as
a worker with threads_per_process 1 runs) times the engine's own GenerationRunner: a decode step
of PROBE_ROWS rows, then the steps that prefill a PROBE_PROMPT-token prompt PROBE_CHUNK tokens at
a time beside them. `decide_batch_tokens` is pure: the largest multiple of CHUNK_STEP whose step,
by the two timings' line, stays within STEP_BUDGET_MS.
"""

from __future__ import annotations

import statistics
import time

PROBE_ROWS = 4
"""Sequences decoding while the probe's prompt prefills: a lightly loaded worker."""
PROBE_PROMPT = 256
PROBE_CHUNK = 128
"""The probe prefills a PROBE_PROMPT-token prompt in chunks of this many tokens."""
STEP_BUDGET_MS = 150.0
"""A chunk's step may take this long: 0.6 of the default 250-ms ITL objective, since the rows
of a loaded worker add to the step and a prefill step is a whole gap of every running row."""
CHUNK_RANGE = (16, 1024)
"""The per-thread chunk auto picks lies within this range."""
CHUNK_STEP = 16
"""Auto picks a multiple of this. A finer grid than powers of two: where a 128-token step sits near
the budget, a probe a few per cent slower picked 64 and a faster one 128, and a static server
kept whichever it drew."""


def time_chunk_steps(model, rows: int = PROBE_ROWS, prompt: int = PROBE_PROMPT, chunk: int = PROBE_CHUNK, decode_steps: int = 5) -> dict:
    """A GenerationRunner with `rows` rows decoding: the median of `decode_steps` decode steps,
    every step while a `prompt`-token prompt prefills `chunk` tokens at a time beside them, and
    the first step after it joined (ms). A model with a short context gets a prompt of half of
    it at most, in chunks as many to the prompt as asked."""
    import torch

    from engine.generation import GenerationRunner, SequenceRequest, _max_positions
    from engine.sampling import SamplingParams

    context = _max_positions(model) or 4096
    if prompt > context // 2:
        prompt, chunk = context // 2, max(1, chunk * (context // 2) // prompt)
    rows_prompt = min(64, prompt)
    params = SamplingParams(max_tokens=context - prompt, temperature=0, ignore_eos=True)
    runner = GenerationRunner(model, [0], max_running=rows + 1, prefill_chunk=None)
    for i in range(rows):
        runner.add(SequenceRequest(i, tuple(range(1000 + i, 1000 + i + rows_prompt)), params))
    with torch.inference_mode():
        runner.step()  # the rows' prompts, whole
        decode = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            runner.step()
            decode.append(time.perf_counter() - start)
        runner.prefill_chunk = chunk
        runner.add(SequenceRequest(rows, tuple(range(2000, 2000 + prompt)), params))
        prefill = []
        while runner.num_waiting or runner.prefilling:
            start = time.perf_counter()
            runner.step()
            prefill.append(time.perf_counter() - start)
        start = time.perf_counter()
        runner.step()
        after = time.perf_counter() - start
    return {"rows": rows, "prompt": prompt, "chunk": chunk, "decode_ms": statistics.median(decode) * 1000,
            "prefill_steps_ms": [round(t * 1000, 1) for t in prefill], "joined_ms": after * 1000}


def probe_batch_tokens(model, rounds: int = 2) -> dict:
    """The probe: `time_chunk_steps` `rounds` times (the first run also warms the kernels up); the
    fastest decode step and the fastest full-chunk step of any round."""
    started = time.perf_counter()
    runs = [time_chunk_steps(model) for _ in range(rounds + 1)][1:]
    full = runs[0]["prompt"] // runs[0]["chunk"]  # the steps that prefill a whole chunk (the last is the one the prompt joins in)
    return {
        "rows": runs[0]["rows"], "chunk": runs[0]["chunk"],
        "decode_ms": round(min(r["decode_ms"] for r in runs), 1),
        "chunk_step_ms": round(min(t for r in runs for t in r["prefill_steps_ms"][:full]), 1),
        "seconds": round(time.perf_counter() - started, 2),
    }


def decide_batch_tokens(probe: dict | None, fallback: int, error: str | None = None) -> dict:
    """Prompt tokens per step per worker thread, from the probe (pure): the largest multiple of
    CHUNK_STEP in CHUNK_RANGE whose step, on the line through the decode step and the chunk step, stays
    within STEP_BUDGET_MS; `fallback` (the constant) without a usable probe."""
    choice: dict = {"budget_ms": STEP_BUDGET_MS}
    if error is not None:
        choice["probe_error"] = error
    if not probe:
        return {**choice, "per_thread": fallback, "reason": f"not measured: {error or 'no probe'}; {fallback} per thread"}
    decode, step, chunk = probe["decode_ms"], probe["chunk_step_ms"], probe["chunk"]
    per_token = max(step - decode, 0.0) / chunk
    choice.update(decode_ms=decode, chunk_step_ms=step, probe_chunk=chunk, ms_per_prompt_token=round(per_token, 4), probe_seconds=probe.get("seconds"))
    fits = (STEP_BUDGET_MS - decode) / per_token if per_token > 0 else CHUNK_RANGE[1]
    tokens = int(max(min(fits, CHUNK_RANGE[1]) // CHUNK_STEP * CHUNK_STEP, CHUNK_RANGE[0]))
    return {**choice, "per_thread": tokens,
            "reason": (f"a decode step of {probe['rows']} rows {decode:.0f} ms, {per_token:.2f} ms a prompt token: "
                       f"{tokens} tokens a step keep it within {STEP_BUDGET_MS:.0f} ms")}
