"""`selftune profile | simulate | tune --task generate`: the offline commands for generation
(autotune/offline/cli.py hands over here when the task is generate)."""

from __future__ import annotations

import json
import os
import sys
import time

from autotune import shipped
from autotune.bench.modes import parse_knobs
from autotune.output import emit, jsonable, say
from engine.config import Knobs

DEFAULT_GEN_COST_MODELS = {"float32": "builtin:epyc-2core-smollm2-generate", "bfloat16": "builtin:epyc-2core-smollm2-generate-bf16"}
"""The shipped generation cost models (SmolLM2 on this 2-core EPYC), by the dtype they were measured in."""
GEN_KNOBS = "process_count=1,threads_per_process=2,max_batch_size=16"
GEN_STATIC_GRID = {"process_count": [1, 2], "threads_per_process": [1, 2], "max_batch_size": [4, 8, 16, 32], "max_batch_tokens": [64, 256, 1024]}
"""The oracle's grid for generation (a tune config's static_grid replaces it)."""


def run_gen_profile(args) -> int:
    from autotune.offline.gen_profiler import FULL, QUICK, profile_generation

    model = profile_generation(args.model, QUICK if args.quick else FULL, say, save_to=args.out, dtype=args.dtype)
    say(f"generation cost model: {args.out} ({len(model.points)} steps timed in {model.dtype})")
    for threads, (p, d) in sorted(model.by_threads.items()):
        say(f"  {threads} thread(s): prefill {p[0] * 1000:.2f} ms + {p[1] * 1e6:.1f} µs/token + {p[2] * 1e9:.3f} ns/token²; "
            f"decode {d[0] * 1000:.2f} ms + {d[1] * 1000:.3f} ms/row + {d[2] * 1e6:.3f} µs/(row·column)")
    emit({"cost_model": args.out, "dtype": model.dtype, "by_threads": model.to_json()["by_threads"], "points": len(model.points)}, args.json)
    return 0


def sim_knobs(text: str, cost_model) -> Knobs:
    """`--knobs` for generation; `max_batch_tokens=auto` is what the live server would measure on
    the machine the cost model was profiled on (per thread, × threads_per_process)."""
    from autotune.offline.gen_costmodel import auto_batch_tokens

    knobs = parse_knobs(text.replace("max_batch_tokens=auto", ""))
    if "max_batch_tokens=auto" in text:
        knobs = knobs.replace(max_batch_tokens=auto_batch_tokens(cost_model)["per_thread"] * knobs.threads_per_process)
    return knobs


SIM_NOISE = ("speed_noise", "speed_noise_seconds", "step_noise", "noise_seed")
"""GenSimConfig's machine-noise fields, taken from the command line where given (their defaults are GenSimConfig's)."""


def gen_sim_config(args, knobs: Knobs | None = None, **extra):
    from autotune.offline.gen_simulator import GenSimConfig

    return GenSimConfig(
        knobs=knobs if knobs is not None else parse_knobs(args.knobs or GEN_KNOBS),
        cores=args.cores or len(os.sched_getaffinity(0)),
        ttft_seconds=args.ttft, itl_seconds=args.itl, startup_seconds=args.startup_seconds,
        max_queued_requests=args.max_queued_requests, queue_timeout=args.queue_timeout,
        control_interval=args.interval, cooldown_seconds=args.cooldown,
        **{key: getattr(args, key) for key in SIM_NOISE if getattr(args, key, None) is not None}, **extra,
    )


def run_gen_simulate(args) -> int:
    from autotune.offline.gen_costmodel import load_gen_cost_model
    from autotune.offline.gen_simulator import simulate_generation
    from autotune.offline.gen_workload import generation_arrivals
    from policies.loader import load_policy

    from autotune.offline.cli import default_cost_model, load_checked_cost_model

    cost_spec = args.cost_model or default_cost_model(args.dtype, DEFAULT_GEN_COST_MODELS)
    try:
        cost_model = load_checked_cost_model(cost_spec, args.dtype, load_gen_cost_model)
        arrivals = generation_arrivals(args.workload, cost_model.max_positions)
        policy = load_policy(str(shipped.resolve(args.policy, shipped.POLICY)))
        config = gen_sim_config(args, sim_knobs(args.knobs or GEN_KNOBS, cost_model))
    except (ValueError, OSError, KeyError) as exc:  # a PolicyError is a ValueError
        print(f"selftune simulate: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = simulate_generation(arrivals, cost_model, config, policy)
    summary = {"task": "generate", "workload": args.workload, "policy": args.policy, "cost_model": cost_spec, "dtype": cost_model.dtype,
               "wall_seconds": round(time.perf_counter() - started, 3), **result.summary()}
    ttft, itl = summary["ttft_seconds"], summary["itl_seconds"]
    say(f"{summary['requests']} generations over {summary['duration_seconds']:.0f} s simulated in {summary['wall_seconds']:.2f} s ({args.policy})")
    say(f"  goodput {summary['goodput']:.3f}/s within TTFT {args.ttft} s and ITL {args.itl} s ({summary['slo_attainment']:.1%})   "
        f"{summary['output_tokens_per_s']:.1f} output tokens/s   rejected {summary['rejected']} (shed {summary['shed']})   preemptions {summary['preemptions']}")
    say(f"  TTFT p50 {ttft['p50']:.3f} p99 {ttft['p99']:.3f} s   ITL p50 {itl['p50']:.3f} p99 {itl['p99']:.3f} s   "
        f"knob changes {summary['changes']}   final {summary['final_knobs']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "simulation.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=jsonable)
        say(f"wrote {args.out}/simulation.json")
    emit(summary, args.json)
    return 0


def gen_tune_problem(config: dict, spec: dict, objective: str, sim_args):
    """A tune config with `task: generate`: its workloads, the generation cost model, the simulator."""
    from autotune.offline.gen_costmodel import load_gen_cost_model
    from autotune.offline.gen_workload import generation_arrivals
    from autotune.offline.tuner import Problem

    cost_model = load_gen_cost_model(str(shipped.resolve(config.get("cost_model", DEFAULT_GEN_COST_MODELS["float32"]), shipped.COST_MODEL)))
    sim_args.ttft = float(config.get("ttft_seconds", 2.0))
    sim_args.itl = float(config.get("itl_seconds", 0.25))
    knobs = Knobs(**config.get("knobs", {}))
    return Problem(
        spec=spec,
        workloads=[generation_arrivals(w, cost_model.max_positions) for w in config.get("workloads", [])],
        cost_model=cost_model,
        sim=gen_sim_config(sim_args, knobs),
        objective=objective,
        space=(config.get("search", {}) or {}).get("params", {}) or {},
    ), knobs
