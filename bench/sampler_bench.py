"""Sampler cost: CPU time of one Observation with 4 workers, as a share of one core at 1 Hz.

Starts an engine with 4 CPU workers, serves a little traffic so every window has data, then
takes `--samples` Observations back to back and measures the sampling thread's own CPU time
(time.thread_time) per sample: the cost the server pays every `monitors.interval_seconds`.

    python bench/sampler_bench.py [--samples 50] [--json]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    knobs = Knobs(process_count=args.workers, threads_per_process=1, max_batch_size=8, batch_timeout=0.002)
    with Engine(EngineConfig(knobs=knobs)) as engine:
        engine.wait_ready(workers=args.workers)
        telemetry = Telemetry(engine, window=10.0)
        for i in range(200):
            engine.embed([f"sentence {i} for the sampler benchmark"] * 4).result(timeout=60)
        costs = []
        for i in range(args.samples):
            started = time.thread_time()
            observation = telemetry.sample_now()
            costs.append(time.thread_time() - started)
            if i % 10 == 0:
                print(f"sample {i}: {costs[-1] * 1000:.2f} ms CPU, {len(observation.workers)} workers", file=sys.stderr)
            time.sleep(0.05)
    result = {
        "workers": args.workers,
        "samples": args.samples,
        "cpu_ms_per_sample_median": statistics.median(costs) * 1000,
        "cpu_ms_per_sample_p90": statistics.quantiles(costs, n=10)[-1] * 1000,
        "share_of_one_core_at_1hz": statistics.median(costs),
    }
    print(f"sampler: {result['cpu_ms_per_sample_median']:.2f} ms CPU per sample (p90 {result['cpu_ms_per_sample_p90']:.2f}) "
          f"= {result['share_of_one_core_at_1hz'] * 100:.2f} % of one core at 1 Hz with {args.workers} workers", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
