"""Sampler cost: CPU time of one Observation with 4 workers, as a share of one core at 1 Hz.

Starts an engine with 4 CPU workers, serves a little traffic so every window has data, then
takes `--samples` Observations and measures the sampling thread's own CPU time
(time.thread_time) per sample. Two series: the ordinary sample, and one that also re-reads
every worker's USS and NUMA pages (page-table walks, done every 30 s); the amortized cost at
1 Hz is ordinary + (detailed - ordinary) / 30.

    python benchmarks/sampler_bench.py [--samples 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from autotune.telemetry import Telemetry
from engine.config import EngineConfig, Knobs
from engine.engine import Engine


def measure(telemetry: Telemetry, samples: int, label: str) -> list[float]:
    telemetry.sample_now()  # the first sample reads everything in any case
    costs = []
    for i in range(samples):
        started = time.thread_time()
        telemetry.sample_now()
        costs.append(time.thread_time() - started)
        if i % 10 == 0:
            print(f"{label} sample {i}: {costs[-1] * 1000:.2f} ms CPU", file=sys.stderr)
        time.sleep(0.05)
    return costs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    knobs = Knobs(process_count=args.workers, threads_per_process=1, max_batch_size=8, batch_timeout=0.002)
    with Engine(EngineConfig(knobs=knobs)) as engine:
        engine.wait_ready(workers=args.workers)
        for i in range(200):
            engine.embed([f"sentence {i} for the sampler benchmark"] * 4).result(timeout=60)
        ordinary = measure(Telemetry(engine, window=10.0), args.samples, "ordinary")
        detailed_telemetry = Telemetry(engine, window=10.0)
        detailed_telemetry.sampler.procs.detail_seconds = 0.0
        detailed = measure(detailed_telemetry, args.samples, "with USS + NUMA pages")
    plain, full = statistics.median(ordinary), statistics.median(detailed)
    amortized = plain + (full - plain) / 30.0
    result = {
        "workers": args.workers,
        "samples": args.samples,
        "cpu_ms_ordinary_median": plain * 1000,
        "cpu_ms_detailed_median": full * 1000,
        "cpu_ms_per_second_at_1hz": amortized * 1000,
        "share_of_one_core_at_1hz": amortized,
    }
    print(f"sampler with {args.workers} workers: {plain * 1000:.2f} ms CPU per ordinary sample, {full * 1000:.2f} ms with "
          f"USS + NUMA pages (every 30 s) -> {amortized * 100:.2f} % of one core at 1 Hz", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
