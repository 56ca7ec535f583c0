"""Continuous batching in-process: selftune's GenerationRunner against transformers' own
(`generate_batch`: ContinuousBatchingManager with its paged cache), same model, same prompts.

    python benchmarks/generation_backends.py [--batches 8,32] [--tokens 32] [--rounds 2] [--json]

Each round runs every (backend, batch) once, interleaved (A, B, A, B), greedy with EOS ignored,
so both produce exactly batch × tokens tokens; it prints output tokens/s per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def prompts(tokenizer, count: int, words: int = 24) -> list[list[int]]:
    from autotune.bench.inputs import sentences

    return [tokenizer(text).input_ids for text in sentences(count, words, words, seed=7)]


def run_selftune(model, eos, batch: list[list[int]], tokens: int) -> float:
    from engine.generation import GenerationRunner, SequenceRequest
    from engine.sampling import SamplingParams

    runner = GenerationRunner(model, eos, max_running=len(batch))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(batch):
        runner.add(SequenceRequest(i, tuple(ids), params))
    produced, started = 0, time.perf_counter()
    while runner.has_work:
        produced += len(runner.step())
    assert produced == len(batch) * tokens, produced
    return produced / (time.perf_counter() - started)


def run_transformers(model, batch: list[list[int]], tokens: int, pad: int, warmup: bool = False) -> float:
    from transformers import GenerationConfig

    # Its default cache and token budget (sized from free memory); a server would warm up once.
    config = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad)
    started = time.perf_counter()
    out = model.generate_batch(inputs=batch, generation_config=config, progress_bar=False, warmup=warmup)
    produced = sum(len(r.generated_tokens) for r in out.values())
    assert produced == len(batch) * tokens, produced
    return produced / (time.perf_counter() - started)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import EngineConfig
    from engine.model_source import resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model, EngineConfig().cache_dir).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="paged|sdpa").eval()
    eos = [tokenizer.eos_token_id]
    batches = [int(b) for b in args.batches.split(",")]
    runs = []
    for b in batches:  # one untimed pass each: first-call costs (kernels, allocations) out of the way
        run_selftune(ours, eos, prompts(tokenizer, b), 4)
        run_transformers(theirs, prompts(tokenizer, b), 4, tokenizer.eos_token_id, warmup=True)
    for round_ in range(args.rounds):
        for b in batches:
            batch = prompts(tokenizer, b)
            for name in ("selftune", "transformers"):
                rate = run_selftune(ours, eos, batch, args.tokens) if name == "selftune" else run_transformers(theirs, batch, args.tokens, tokenizer.eos_token_id)
                runs.append({"round": round_ + 1, "backend": name, "batch": b, "tokens_per_second": round(rate, 1)})
                print(f"round {round_ + 1}  batch {b:3d}  {name:12s} {rate:7.1f} tokens/s", file=sys.stderr, flush=True)
    result = {"model": args.model, "threads": args.threads, "tokens": args.tokens, "torch": torch.__version__, "runs": runs}
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
