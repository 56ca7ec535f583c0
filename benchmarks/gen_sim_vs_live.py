"""A live generate replay beside the simulator's run of the same arrivals, lengths and knobs.

    python benchmarks/gen_sim_vs_live.py OUT_DIR [OUT_DIR ...] --cost-model FILE [--cost-model FILE ...]
        [--policy configs/policies/generate.yaml] [--queue-timeout 1.5] [--seeds 0,1,2]

Each OUT_DIR is a finished `selftune bench --task generate --workload ...` run of one mode. The
simulator replays its workload (the bench's arrivals, and lengths drawn from the trace as the
bench draws them) from the mode's start knobs, with `--policy` where the mode ran one (it made
decisions), and a VM's wandering speed (noise 0.08 over 10 s, 0.1 per step, as the noisy
simulator runs of docs/BENCHMARKS.md). Per side: requests refused (429), served with TTFT over
the objective, served with a mean gap over it, good (within both), and the served requests'
median mean gap and TTFT. Where the two agree on a mode the simulator can rank other knobs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os

import numpy as np

from autotune.bench import gen_inputs
from autotune.bench.workloads import from_spec
from autotune.offline.gen_costmodel import load_gen_cost_model
from autotune.offline.gen_simulator import GenSimConfig, simulate_generation
from engine.config import Knobs
from policies.loader import load_policy


def counts(refused, ttft, gap, ttft_slo: float, gap_slo: float) -> dict:
    served = ~refused & ~np.isnan(ttft)
    late, slow = served & (ttft > ttft_slo), served & (gap > gap_slo)
    return {"refused": int(refused.sum()), "ttft over": int(late.sum()), "gap over": int(slow.sum()),
            "good": int((served & ~late & ~slow).sum()), "gap p50 ms": float(np.nanmedian(gap[served])) * 1000,
            "ttft p50 ms": float(np.nanmedian(ttft[served])) * 1000}


def live(folder: str, mode: str, ttft_slo: float, gap_slo: float) -> dict:
    with open(os.path.join(folder, "requests.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r["mode"] == mode]
    number = lambda v: float(v) if v else np.nan  # noqa: E731
    refused = np.array([r["status"] == "429" for r in rows])
    ttft = np.array([number(r["ttft"]) if r["status"] == "200" else np.nan for r in rows])
    return counts(refused, ttft, np.array([number(r["itl_mean"]) for r in rows]), ttft_slo, gap_slo)


def bench_arrivals(bench: dict) -> list[tuple[float, int, int]]:
    """The run's (arrival, prompt tokens, output tokens): request i carries the bench's i-th drawn lengths, cycled."""
    requests = bench["requests"]
    table = gen_inputs.read_lengths(gen_inputs.locate(requests["trace"]))
    # runs before the bench recorded min_prompt_tokens were all SmolLM2's: one special token, so 2
    pairs = gen_inputs.draw_lengths(table, requests["pairs"], bench["seed"], requests["max_prompt_tokens"], requests["max_output_tokens"],
                                    min_prompt=requests.get("min_prompt_tokens", 2))
    return [(t, *pairs[i % len(pairs)]) for i, (t, _) in enumerate(from_spec(bench["workload"]))]


def simulated(bench: dict, mode: dict, arrivals, cost_model, policy: str | None, queue_timeout: float | None, seed: int) -> dict:
    started = mode["timeline"][0] if mode.get("timeline") else mode["start_knobs"]  # the server's first /stats: `auto` resolved
    knobs = Knobs(**{k: v for k, v in started.items() if k in Knobs.__dataclass_fields__})
    config = GenSimConfig(knobs=knobs, cores=bench["machine"]["usable_cores"], ttft_seconds=bench["ttft_slo_seconds"], itl_seconds=bench["itl_slo_seconds"],
                          speed_noise=0.08, step_noise=0.1, noise_seed=seed, queue_timeout=queue_timeout)
    r = simulate_generation(arrivals, cost_model, config, load_policy(policy) if policy else None)  # a fresh policy: it keeps state
    return counts(r.rejected, np.where(r.rejected, np.nan, r.first - r.arrival), r.mean_gap, config.ttft_seconds, config.itl_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="selftune bench --out folders of generate workload replays, one mode each")
    parser.add_argument("--cost-model", action="append", required=True, help="generation cost model JSON (repeatable)")
    parser.add_argument("--policy", help="the policy file the autotuned and default modes ran")
    parser.add_argument("--queue-timeout", type=float, help="the bench's --queue-timeout, if it had one")
    parser.add_argument("--seeds", default="0", help="noise seeds of the simulated side, comma-separated")
    args = parser.parse_args()
    show = lambda d: "  ".join(f"{k} {v:.0f}" for k, v in d.items())  # noqa: E731
    cost_models = {path: load_gen_cost_model(path) for path in args.cost_model}
    for folder in args.folders:
        with open(os.path.join(folder, "bench.json")) as f:
            bench = json.load(f)
        (mode,) = bench["modes"]
        ran_policy = bool(mode.get("decisions"))
        arrivals = bench_arrivals(bench)
        print(f"{folder} ({mode['mode']}, {'policy' if ran_policy else 'static'}), live:  {show(live(folder, mode['mode'], bench['ttft_slo_seconds'], bench['itl_slo_seconds']))}")
        for path, cost_model in cost_models.items():
            for seed in (int(s) for s in args.seeds.split(",")):
                got = simulated(bench, mode, arrivals, cost_model, args.policy if ran_policy else None, args.queue_timeout, seed)
                print(f"    simulated on {os.path.basename(path)}, seed {seed}:  {show(got)}")


if __name__ == "__main__":
    main()
