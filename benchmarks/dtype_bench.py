"""Embedding dtypes and backends in-process: fp32, bf16 mixed (what `model.dtype: bfloat16`/`auto`
serve), bf16 cast whole (what bfloat16 was before), through the worker's own EmbeddingRunner, and
ONNX Runtime fp32 (`model.backend: onnxruntime`, padded only) through its OnnxEmbeddingRunner.

Sentences/s at each batch size, packed (the server's default, 128-token rows) and padded, the
variants interleaved round by round (the machine's speed drifts: compare within a round); the
worst cosine of each variant to fp32 (each text alone) over the bench's sentences and very
short inputs; optionally a torch.profiler table of one batch per variant.

    python benchmarks/dtype_bench.py [--batches 1,4,16,64] [--rounds 2] [--seconds 1]
                                     [--threads 1] [--profile 16] [--no-onnx] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time

import numpy as np


def load(threads: int):
    import torch

    torch.set_num_threads(threads)
    from engine.loading import load_model, load_tokenizer
    from engine.model_source import resolve_model

    path = resolve_model("builtin:minilm", "/nonexistent").path
    fp32 = load_model(path, "embed", torch.float32)
    variants = {
        "fp32": fp32,
        "bf16 mixed": load_model(path, "embed", torch.bfloat16),
        "bf16 cast": copy.deepcopy(fp32).to(torch.bfloat16),
    }
    return load_tokenizer(path), variants


def onnx_runner(fp32, threads: int):
    """ONNX Runtime on the model's export, made (or found) where the server keeps it."""
    from engine.config import default_cache_dir
    from engine.model_source import resolve_model
    from engine.onnx_embedding import OnnxEmbeddingRunner, export, export_path

    path = export_path(resolve_model("builtin:minilm", "/nonexistent").path, default_cache_dir())
    return OnnxEmbeddingRunner(export(fp32, path), threads)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


def batch_of(ids: list[list[int]]):
    lengths = tuple(len(x) for x in ids)
    matrix = np.zeros((len(ids), max(lengths)), dtype=np.int32)
    for row, x in enumerate(ids):
        matrix[row, : len(x)] = x
    return matrix, lengths


def throughput(runner, ids, batch: int, seconds: float, cursor: int) -> float:
    out = np.empty((batch, 384), dtype=np.float32)
    done, started = 0, time.perf_counter()
    while True:
        chunk = [ids[(cursor + i) % len(ids)] for i in range(batch)]
        cursor += batch
        runner.run(*batch_of(chunk), out)
        done += batch
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return done / elapsed


def embed_all(runner, ids, batch: int) -> np.ndarray:
    out = np.empty((len(ids), 384), dtype=np.float32)
    for start in range(0, len(ids), batch):
        chunk = ids[start : start + batch]
        runner.run(*batch_of(chunk), out[start : start + len(chunk)])
    return out


def fidelity(variants, runners_for, ids, others=None) -> dict:
    """Worst cosine to fp32 (each text alone): each variant packed and padded in batches of 16,
    each of `others` (name -> runner) as it runs."""
    reference = embed_all(runners_for(variants["fp32"], 0), ids, 1)
    result = {name: {"min_cosine": float((embed_all(runner, ids, 16) * reference).sum(axis=1).min())} for name, runner in (others or {}).items()}
    for name, model in variants.items():
        worst = 1.0
        for pack, batch in ((128, 16), (0, 16)):
            cosine = (embed_all(runners_for(model, pack), ids, batch) * reference).sum(axis=1)
            worst = min(worst, float(cosine.min()))
        result[name] = {"min_cosine": worst}
    return result


def profile(runner, ids, batch: int, rows: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    matrix, lengths = batch_of(ids[:batch])
    out = np.empty((batch, 384), dtype=np.float32)
    for _ in range(3):
        runner.run(matrix, lengths, out)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            runner.run(matrix, lengths, out)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_ms_per_batch": e.self_cpu_time_total / 5e3, "share": e.self_cpu_time_total / total, "calls_per_batch": e.count / 5}
            for e in events]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per cell")
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's threads_per_process)")
    ap.add_argument("--words", default="8-48", help="MIN-MAX words per sentence, as the bench's ladder")
    ap.add_argument("--profile", type=int, default=0, metavar="BATCH", help="also profile one packed batch of this size per variant")
    ap.add_argument("--no-onnx", action="store_true", help="leave ONNX Runtime out (it needs the `onnx` extra)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    args = ap.parse_args(argv)

    import torch

    from autotune.bench.inputs import sentences
    from engine.embedding import EmbeddingRunner
    from engine.loading import cpu_flags, token_ids

    tokenizer, variants = load(args.threads)
    low, high = (int(x) for x in args.words.split("-"))
    ids = token_ids(tokenizer, sentences(512, low, high, seed=0))
    short = token_ids(tokenizer, sentences(64, 1, 3, seed=1) + ["ok", "yes", "no", "hi", "?", "42", "thanks!"])

    def runner_for(model, pack):
        return EmbeddingRunner(model, "cpu", pack, 30522)

    runners = {(name, pack): runner_for(model, pack) for name, model in variants.items() for pack in (128, 0)}
    others = {} if args.no_onnx else {"onnxruntime": onnx_runner(variants["fp32"], args.threads)}
    runners.update({(name, 0): runner for name, runner in others.items()})
    batches = [int(b) for b in args.batches.split(",")]
    table: dict[str, dict[str, list[float]]] = {}
    for batch in batches:
        for runner in runners.values():
            throughput(runner, ids, batch, 0.2, 0)  # warm-up at this batch size
        for r in range(args.rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name, pack in order:
                value = throughput(runners[(name, pack)], ids, batch, args.seconds, 97 * r)
                table.setdefault(f"{name} {'packed' if pack else 'padded'}", {}).setdefault(str(batch), []).append(value)
        print(f"batch {batch}: " + "  ".join(f"{k} {'/'.join(f'{v:.0f}' for v in cells[str(batch)])}" for k, cells in table.items()), file=sys.stderr)

    result = {
        "machine": {"cpu": cpu_model(), "bf16_flags": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"}),
                    "torch": torch.__version__, "threads": args.threads},
        "sentences_per_second": table,
        "fidelity_bench_sentences": fidelity(variants, runner_for, ids[:128], others),
        "fidelity_short_inputs": fidelity(variants, runner_for, short, others),
    }
    if args.profile:
        result["profile"] = {name: profile(runners[(name, 128)], ids, args.profile) for name in variants}

    print(f"| variant | {' | '.join(f'batch {b}' for b in batches)} |")
    print("|---|" + "---|" * len(batches))
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join("/".join(f"{v:.0f}" for v in cells[str(b)]) for b in batches) + " |")
    print("\nsentences/s, one value per interleaved round")
    for name in [*variants, *others]:
        print(f"{name}: worst cosine to fp32, bench sentences {result['fidelity_bench_sentences'][name]['min_cosine']:.6f}, "
              f"short inputs {result['fidelity_short_inputs'][name]['min_cosine']:.6f}")
    for name, rows in result.get("profile", {}).items():
        print(f"\nprofile, {name}, one packed batch of {args.profile}: "
              + ", ".join(f"{r['op'].removeprefix('aten::')} {r['self_ms_per_batch']:.1f} ms" for r in rows[:6]))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
