"""Placement benchmark: saturated throughput with placement auto vs none, 2 workers × 1 thread.

Runs alternate (auto, none, auto, none, ...) so slow drift of this VM's speed hits both
modes alike; reports each run and the mean per mode.

    python benchmarks/placement_bench.py [--rounds 3] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from autotune.bench.inputs import texts_of_tokens  # noqa: E402
from autotune.bench.machine import LoadMonitor  # noqa: E402
from autotune.bench.saturate import TARGET_TOKENS, saturate  # noqa: E402
from engine.config import EngineConfig, Knobs  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loading import load_tokenizer  # noqa: E402
from engine.model_source import resolve_model  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    source = resolve_model("builtin:minilm", cache_dir="/nonexistent")
    texts = texts_of_tokens(load_tokenizer(source.path), tokens=TARGET_TOKENS)
    knobs = Knobs(process_count=2, threads_per_process=1, io_threads=2, batch_timeout=0.002, max_batch_size=64)
    mon = LoadMonitor()
    runs = {"auto": [], "none": []}
    try:
        for round_ in range(args.rounds):
            for mode in ("auto", "none"):
                log(f"round {round_ + 1}/{args.rounds}: placement {mode}")
                with Engine(EngineConfig(knobs=knobs, placement=mode)) as eng:
                    eng.wait_ready(workers=2)
                    cpus = [w.cpus for w in eng.stats().workers]
                    result = saturate(eng, texts, outstanding=512, warmup=3.0, duration=args.seconds, label=mode, mon=mon, log=log)
                runs[mode].append(result["throughput"])
                log(f"  placement {mode}: {result['throughput']:.1f} req/s (worker cpus {cpus})")
    finally:
        mon.close()
    summary = {mode: {"runs": values, "mean": statistics.fmean(values)} for mode, values in runs.items()}
    print("| placement | runs (req/s) | mean |\n|---|---|---|", file=sys.stderr)
    for mode, s in summary.items():
        print(f"| {mode} | {', '.join(f'{v:.0f}' for v in s['runs'])} | {s['mean']:.0f} |", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
