"""Memory of an embedding worker's runner over many batches of mixed shapes, in-process.

Runs the worker's own EmbeddingRunner (fp32 or bf16 mixed, packed or padded) on `--batches`
batches of random rows and lengths (seeded; ids are random, only the shapes matter to memory),
reads the process's RSS every `--every` batches (and times the runner: inputs a second), and at
the end calls glibc's `malloc_trim(0)` and reads it again: what the trim gives back was freed
memory the allocator kept, not a leak.
Each variant runs in a fresh subprocess, so one variant's heap does not carry into the next.
Prints a table, and with `--plot FILE` draws RSS against batches.

    python benchmarks/embed_memory.py [--variants fp32-packed,bf16-packed,...] [--batches 1500]
                                      [--every 100] [--max-rows 32] [--tokens 5-60] [--plot rss.png] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

import psutil

VARIANTS = ("fp32-packed", "bf16-packed", "fp32-padded", "bf16-padded")


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_variant(variant: str, batches: int, every: int, max_rows: int, tokens: tuple[int, int], seed: int, threads: int) -> dict:
    import numpy as np

    from engine import packing
    from engine.embedding import load_served_runner
    from engine.model_source import resolve_model

    dtype, layout = variant.split("-")
    path = resolve_model("builtin:minilm", "/nonexistent").path
    runner = load_served_runner(path, {"fp32": "float32", "bf16": "bfloat16"}[dtype],
                                packing.DEFAULT_ROW_TOKENS if layout == "packed" else 0, threads)
    rng = np.random.default_rng(seed)
    samples = [(0, rss_mib())]
    shapes = set()
    busy, items = 0.0, 0
    for b in range(1, batches + 1):
        rows = int(rng.integers(1, max_rows + 1))
        lengths = tuple(int(n) for n in rng.integers(tokens[0], tokens[1] + 1, rows))
        ids = rng.integers(1000, 20000, (rows, max(lengths))).astype(np.int32)
        out = np.empty((rows, runner.hidden_size), dtype=np.float32)
        started = time.perf_counter()
        runner.run(ids, lengths, out)
        busy += time.perf_counter() - started
        items += rows
        shapes.add(packing.shape(lengths, runner.pack_row_tokens))
        if b % every == 0:
            samples.append((b, rss_mib()))
    before_trim = rss_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"variant": variant, "samples": samples, "shapes": len(shapes), "rss_before_trim": before_trim, "rss_after_trim": rss_mib(),
            "inputs_per_second": items / busy, "cache_capacity": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--max-rows", type=int, default=32)
    ap.add_argument("--tokens", default="5-60", help="each input's length in tokens, lo-hi")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", help="a PNG of RSS against batches")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one variant here and print its JSON (the subprocess)
    args = ap.parse_args(argv)
    tokens = tuple(int(x) for x in args.tokens.split("-"))
    if args.one:
        print(json.dumps(run_variant(args.one, args.batches, args.every, args.max_rows, tokens, args.seed, args.threads)))
        return 0
    results = []
    for variant in args.variants.split(","):
        print(f"{variant}: {args.batches} batches ...", file=sys.stderr, flush=True)
        command = [sys.executable, __file__, "--one", variant] + [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        s = result["samples"]
        print(f"  RSS {s[0][1]:.0f} -> {s[1][1]:.0f} (after {s[1][0]}) -> {s[-1][1]:.0f} MiB (after {s[-1][0]}); "
              f"{result['shapes']} shapes; after malloc_trim {result['rss_after_trim']:.0f} MiB; {result['inputs_per_second']:.0f} inputs/s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print("| variant | RSS loaded | after the first " + str(args.every) + " | half-way | at the end | distinct shapes | after malloc_trim(0) | inputs/s in the runner |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            s = r["samples"]
            print(f"| {r['variant']} | {s[0][1]:.0f} | {s[1][1]:.0f} | {s[len(s) // 2][1]:.0f} | {s[-1][1]:.0f} | {r['shapes']} | {r['rss_after_trim']:.0f} | {r['inputs_per_second']:.0f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in results:
            xs, ys = zip(*r["samples"])
            ax.plot(xs, ys, marker=".", label=f"{r['variant']} (trim -> {r['rss_after_trim']:.0f})")
        ax.set_xlabel("batches")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("embedding runner RSS over batches of mixed shapes")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
