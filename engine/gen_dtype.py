"""`model.dtype: auto` for generation on a CPU: bf16 where it is native, keeps the next tokens, and is faster.

The probe (run in the zygote's probe child) casts a copy of the fp32 model to bf16 and compares
the two on the fixed probe texts, teacher-forced: at every position, whether bf16's greedy next
token is fp32's or one fp32 itself finds nearly as likely (a near tie, where either is a fair
pick), and the mean KL divergence of bf16's next-token distribution from fp32's. It then times decode steps of the engine's own GenerationRunner
with PROBE_ROWS running sequences in each dtype, interleaved. `decide_generation_dtype` is pure.
"""

from __future__ import annotations

import copy
import time

from engine.loading import MIN_SPEEDUP, decided_before_probe

NEAR_TIE = 0.5
"""bf16's pick is a near tie of fp32's when fp32 gives it at least this share of its top token's probability."""
MIN_TOKEN_AGREEMENT = 0.99
"""`dtype: auto` keeps bf16 for generation only if, over the probe texts' positions, bf16's greedy
pick is fp32's or a near tie of it at least this often. Plain top-1 agreement would not do: a
small model's next token is often nearly tied at the start of a text, and rounding tips it."""
PROBE_ROWS = 8
"""Sequences decoding together in the timed steps: a small batch, as a lightly loaded server runs."""


def probe_generation_dtype(model, ids: list[list[int]], eos_token_ids=(), rounds: int = 5, steps: int = 4) -> dict:
    """The fp32 `model` against a bf16 copy: greedy next-token agreement over every position of
    `ids` (teacher-forced, one text at a time), and the decode step time of each in a
    GenerationRunner holding PROBE_ROWS sequences (the fastest of `rounds` rounds of `steps`
    steps, the two dtypes' rounds interleaved). Leaves `model` as it was."""
    import torch

    from engine.embedding import interleaved
    from engine.generation import GenerationRunner, SequenceRequest
    from engine.sampling import SamplingParams

    started = time.perf_counter()
    trial = copy.deepcopy(model).to(torch.bfloat16)
    same = near = total = 0
    kl = 0.0
    with torch.inference_mode():
        for x in ids:
            tokens = torch.tensor([x], dtype=torch.long)
            p, q = (m(tokens).logits[0].float().softmax(-1) for m in (model, trial))
            want, got = p.argmax(-1), q.argmax(-1)
            tie = p.gather(-1, got[:, None])[:, 0] >= NEAR_TIE * p.max(-1).values
            same, near, total = same + int((want == got).sum()), near + int(((want == got) | tie).sum()), total + len(x)
            kl += float((p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum())
    params = SamplingParams(max_tokens=rounds * steps + 8, temperature=0, ignore_eos=True)
    runners = {}
    for name, m in (("float32", model), ("bfloat16", trial)):
        runners[name] = runner = GenerationRunner(m, tuple(eos_token_ids), max_running=PROBE_ROWS)
        for row in range(PROBE_ROWS):
            runner.add(SequenceRequest(row, tuple(ids[row % len(ids)]), params))
        runner.step()  # the prefill, untimed
    # the embedding probe's rotating rounds; the prefill above warmed both runners
    per_round = interleaved(runners, lambda runner: [runner.step() for _ in range(steps)], rounds, warm=set(runners))
    times = {name: [round(ms / steps, 2) for ms in values] for name, values in per_round.items()}
    return {
        "probe_texts": len(ids), "positions": total, "token_agreement": near / max(total, 1), "top1_agreement": same / max(total, 1),
        "mean_kl": kl / max(total, 1),
        "float32_step_ms": times["float32"], "bfloat16_step_ms": times["bfloat16"],
        "speedup": min(times["float32"]) / min(times["bfloat16"]), "rows": PROBE_ROWS,
        "seconds": round(time.perf_counter() - started, 3),
    }


def decide_generation_dtype(requested: str, native: tuple[bool, str] | None, probe: dict | None, error: str | None = None) -> dict:
    """`model.dtype: auto`'s choice for generation on a CPU, from the native-bf16 check and the
    probe (pure): bfloat16 only with native bf16, MIN_TOKEN_AGREEMENT and MIN_SPEEDUP; else
    float32. A forced dtype is kept as asked. The whole model is cast (`mode: cast`)."""
    choice: dict = {"requested": requested, "backend": "torch"}
    if native is not None:
        choice["native_bf16"], choice["native_bf16_reason"] = native
    if probe:
        choice.update({f"bf16_{k}": probe[k] for k in ("token_agreement", "top1_agreement", "mean_kl", "speedup") if k in probe})
        choice.update(float32_step_ms=probe.get("float32_step_ms"), bf16_step_ms=probe.get("bfloat16_step_ms"),
                      probe_texts=probe.get("probe_texts"), probe_seconds=probe.get("seconds"))
    if error is not None:
        choice["probe_error"] = error
    settled = decided_before_probe(requested, native, probe, error)
    if settled is not None:
        dtype, reason = settled
    elif probe["token_agreement"] < MIN_TOKEN_AGREEMENT:
        dtype, reason = "float32", f"bf16 picks fp32's next token (or a near tie) at {probe['token_agreement']:.1%} of the probe positions (< {MIN_TOKEN_AGREEMENT:.0%})"
    elif probe["speedup"] < MIN_SPEEDUP:
        dtype, reason = "float32", f"a bf16 decode step only {probe['speedup']:.2f}x fp32's (< {MIN_SPEEDUP}x)"
    else:
        dtype, reason = "bfloat16", (f"native bf16, fp32's next token (or a near tie) at {probe['token_agreement']:.1%} of the probe positions, "
                                     f"decode steps {probe['speedup']:.2f}x fp32's")
    choice["dtype"], choice["reason"] = dtype, reason
    choice["mode"] = "fp32" if dtype == "float32" else "cast"
    choice["min_cosine"] = 1.0 if dtype == "float32" else None  # a cosine of embeddings: not what generation is judged by
    return choice
