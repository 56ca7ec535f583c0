"""`selftune profile | simulate | tune | validate`: the offline commands, wired into the main CLI by `register`.

Each one prints a human-readable report and progress on stderr; with `--json` its last stdout
line is one JSON object with the results, so scripts can read it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import yaml

from autotune import shipped
from autotune.output import emit, jsonable, say
from autotune.bench.modes import parse_knobs
from engine.config import INFLIGHT_BATCHES, Knobs

DEFAULT_COST_MODEL = "builtin:epyc-2core-minilm"
DEFAULT_COST_MODELS = {"float32": DEFAULT_COST_MODEL, "bfloat16": "builtin:epyc-2core-minilm-bf16"}
"""The shipped embedding cost models (MiniLM on this 2-core EPYC), by the dtype they were measured in."""
STATIC_POLICY = "builtin:static"
CALIBRATED_COST_MODEL = "costmodel-calibrated.json"


def register(subparsers) -> None:
    """Add the profile, simulate and tune subcommands to the `selftune` parser."""
    p = subparsers.add_parser("profile", help="measure the model on this machine and fit a cost model")
    p.add_argument("--model", help="default: builtin:minilm (embed), builtin:smollm2 (generate)")
    p.add_argument("--task", default="embed", choices=["embed", "generate"], help="generate: time the generation runner's steps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="embed: model.dtype to profile: auto (the default) measures what the server chooses on this CPU (the zygote's own choice)")
    p.add_argument("--quick", action="store_true", help="a small grid (under ~3 minutes on 2 cores)")
    p.add_argument("--out", default="costmodel.json", help="cost model JSON to write (a PNG goes beside it); "
                   "`simulate`/`tune`/`validate --cost-model` take it")
    p.add_argument("--seed", type=int, default=0, help="seeds the held-out split")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_profile)

    s = subparsers.add_parser("simulate", help="run a workload through the simulated engine under a policy")
    s.add_argument("--workload", required=True, help="`kind:key=value,...` (see autotune/bench/workloads.py) or a YAML file")
    s.add_argument("--task", default="embed", choices=["embed", "generate"],
                   help="generate: sequences with prompt and output lengths (a trace's ContextTokens/GeneratedTokens, or output=N)")
    s.add_argument("--policy", default=STATIC_POLICY, help="policy file or builtin:NAME (as `selftune serve --policy`)")
    s.add_argument("--cost-model", default=None, help="cost model JSON or builtin:NAME (default: the shipped one for --dtype, "
                   f"{' or '.join(DEFAULT_COST_MODELS.values())}; generate: a generation cost model)")
    _dtype_argument(s)
    s.add_argument("--slo", type=float, default=0.5, help="latency objective in seconds")
    s.add_argument("--ttft", type=float, default=2.0, help="generate: time-to-first-token objective (seconds)")
    s.add_argument("--itl", type=float, default=0.25, help="generate: mean inter-token gap objective (seconds)")
    _sim_arguments(s)
    s.add_argument("--out", help="directory for simulation.json and simulation.png")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=run_simulate)

    t = subparsers.add_parser("tune", help="tune a policy's parameters (and the static knobs) in the simulator")
    t.add_argument("--config", required=True, help="tune config YAML, or builtin:NAME (configs/tune/NAME.yaml)")
    t.add_argument("--policy", help="policy file or builtin:NAME to tune (overrides the config's)")
    t.add_argument("--objective", choices=["goodput", "slo_attainment", "cost_per_request"])
    t.add_argument("--method", choices=["differential_evolution", "nelder-mead", "grid"])
    t.add_argument("--out", help="directory for the tuned policy YAML and tune.json")
    t.add_argument("--json", action="store_true")
    t.set_defaults(run=run_tune)

    v = subparsers.add_parser("validate", help="run workloads on a live server and in the simulator, side by side")
    v.add_argument("--workload", action="append", help="a workload spec (repeatable); default: Poisson at each of --rates")
    v.add_argument("--rates", default="20,60,100,140,180", help="Poisson rates (req/s) for the default workloads, light to overload")
    v.add_argument("--seconds", type=float, default=40.0, help="length of each default workload")
    v.add_argument("--length", default="16-64", help="input tokens of the default workloads and the calibration (N or LOW-HIGH)")
    v.add_argument("--policy", help="a policy file or builtin:NAME, for both sides (default: static knobs)")
    v.add_argument("--cost-model", default=None, help="cost model JSON or builtin:NAME (default: the shipped one for --dtype); "
                   f"--calibrate writes into it, or into ./{CALIBRATED_COST_MODEL} for a builtin one")
    v.add_argument("--model", default="builtin:minilm")
    _dtype_argument(v)
    v.add_argument("--slo", type=float, default=0.5)
    _sim_arguments(v)
    v.add_argument("--calibrate", action="store_true", help="first measure what the simulator does not model on a live server (a "
                   "light load, then --calibrate-rate), write it into the cost model's `serving` section, and simulate with it")
    v.add_argument("--calibrate-rate", type=float, default=100.0, help="req/s of the busy calibration load: every worker busy, the server keeping up")
    v.add_argument("--out", help="directory for validate.json, validate.md and validate.png")
    v.add_argument("--json", action="store_true")
    v.set_defaults(run=run_validate, knobs_default="process_count=2,threads_per_process=1,max_batch_size=16,batch_timeout=0.005")


def _dtype_argument(parser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model.dtype of the server simulated (and, for validate, started): the cost model must have been measured with it")


def default_cost_model(dtype: str, shipped_models: dict[str, str] = DEFAULT_COST_MODELS) -> str:
    """The shipped cost model for a server with model.dtype `dtype` here: bf16's where it serves
    bf16 (auto: on a CPU with native bf16, where the start-up probe picks it), else fp32's."""
    from engine.loading import native_bf16

    served = "bfloat16" if dtype == "bfloat16" or (dtype == "auto" and native_bf16("cpu")[0]) else "float32"
    return shipped_models[served]


def load_checked_cost_model(spec: str, dtype: str, load=None):
    """The cost model at `spec` (read by `load`: the embedding one's reader by default), held
    against model.dtype `dtype` (costmodel.check_dtype): a ValueError naming both when they
    certainly differ, a warning on stderr when they may."""
    from autotune.offline.costmodel import check_dtype, load_cost_model
    from engine.loading import native_bf16

    model = (load or load_cost_model)(str(shipped.resolve(spec, shipped.COST_MODEL)))
    warning = check_dtype(model, dtype, native_bf16("cpu") if dtype == "auto" else None, f"cost model {spec}")
    if warning:
        say(f"warning: {warning}")
    return model


def _sim_arguments(parser) -> None:
    parser.add_argument("--knobs", default=None, help="starting knobs, e.g. process_count=2,max_batch_size=8,batch_timeout=0.005 (generate: max_batch_tokens=auto is what the live server would measure, read off the cost model)")
    parser.add_argument("--cores", type=int, default=None, help="cores the workers share (default: this machine's)")
    parser.add_argument("--max-inflight-batches", type=int, default=INFLIGHT_BATCHES)
    parser.add_argument("--startup-seconds", type=float, default=1.0)
    parser.add_argument("--max-queued-requests", type=int, default=512)
    parser.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                        help="limits.queue_timeout_seconds: refuse (429) a request still waiting for a worker after this (default: off)")
    parser.add_argument("--interval", type=float, default=2.0, help="controller interval (autotune.interval_seconds)")
    parser.add_argument("--cooldown", type=float, default=4.0, help="controller cooldown (autotune.cooldown_seconds)")
    parser.add_argument("--speed-noise", type=float, default=None, help="generate: the machine's speed wanders, every step's time x exp(x), x of this standard deviation (default 0: none)")
    parser.add_argument("--speed-noise-seconds", type=float, default=None, help="generate: the correlation time of that wandering (default 10 s)")
    parser.add_argument("--step-noise", type=float, default=None, help="generate: each step's own lognormal jitter, the standard deviation of its log (default 0)")
    parser.add_argument("--noise-seed", type=int, default=None, help="generate: the seed of both noises (default 0)")


def sim_config(args, slo: float, knobs: Knobs | None = None, serving: dict | None = None, **extra):
    """The simulated server from the command line; per-request serving costs from the cost model."""
    from autotune.offline.simulator import SimConfig

    serving = serving or {}
    return SimConfig(
        request_overhead_seconds=float(serving.get("request_overhead_seconds", 0.0)),
        model_time_factor=float(serving.get("model_time_factor", 1.0)),
        request_overhead_percentiles=tuple(serving.get("request_overhead_percentiles", ())),
        model_time_percentiles=tuple(serving.get("model_time_percentiles", ())),
        knobs=knobs if knobs is not None else parse_knobs(args.knobs or getattr(args, "knobs_default", "")),
        cores=args.cores or len(os.sched_getaffinity(0)),
        slo_seconds=slo,
        max_inflight_batches=args.max_inflight_batches,
        startup_seconds=args.startup_seconds,
        max_queued_requests=args.max_queued_requests,
        queue_timeout=args.queue_timeout,
        control_interval=args.interval,
        cooldown_seconds=args.cooldown,
        **extra,
    )


def load_workload(spec):
    """A workload spec string, a YAML file holding one spec mapping, or a mapping."""
    from autotune.bench.workloads import from_spec

    if isinstance(spec, str) and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            spec = yaml.safe_load(f)
    return from_spec(spec)


# ---- profile -------------------------------------------------------------------------------


def run_profile(args) -> int:
    from autotune.offline.profiler import FULL, QUICK, plot, profile

    if args.task == "generate":
        from autotune.bench.gen_cli import DEFAULT_MODEL
        from autotune.offline.gen_cli import run_gen_profile

        args.model = args.model or DEFAULT_MODEL
        return run_gen_profile(args)

    model = profile(args.model or "builtin:minilm", args.dtype, QUICK if args.quick else FULL, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model.save(args.out)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(model, png)
    fit = model.fit
    say(f"cost model: {args.out} (+ {png})")
    b = model.backend
    say(f"  measured as {b['name']} {b['dtype']} ({b['mode']}); model.dtype {b['requested']}: {b['reason']}")
    say("  t = (a + b·B·L + c·B·L²)/speedup(threads) × contention + o·oversubscription")
    say("  " + ", ".join(f"{n}={v:.4g}" for n, v in zip("abcfsko", model.coefficients())))
    say(f"  {len(model.points)} points, {fit['heldout_points']} held out: held-out MAPE {fit['heldout_mape']:.1%}, max {fit['heldout_max_ape']:.1%} (train {fit['train_mape']:.1%})")
    emit({"cost_model": args.out, "png": png, "fit": fit, "coefficients": model.to_json()["coefficients"], "backend": model.backend, "machine": model.machine}, args.json)
    return 0


# ---- simulate ------------------------------------------------------------------------------


def run_simulate(args) -> int:
    from autotune.offline.simulator import plot_timeline, simulate
    from policies.loader import load_policy

    if args.task == "generate":
        from autotune.offline.gen_cli import run_gen_simulate

        return run_gen_simulate(args)
    args.cost_model = args.cost_model or default_cost_model(args.dtype)

    try:
        arrivals = load_workload(args.workload)
        policy = load_policy(str(shipped.resolve(args.policy, shipped.POLICY)))
        cost_model = load_checked_cost_model(args.cost_model, args.dtype)
        config = sim_config(args, args.slo, serving=cost_model.serving)
    except (ValueError, OSError) as exc:  # a PolicyError is a ValueError
        print(f"selftune simulate: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = simulate(arrivals, cost_model, config, policy)
    wall = time.perf_counter() - started
    summary = {"workload": args.workload, "policy": args.policy, "cost_model": args.cost_model, "wall_seconds": round(wall, 3), **result.summary()}
    _report_simulation(summary)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "simulation.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=jsonable)
        plot_timeline(result, os.path.join(args.out, "simulation.png"))
        write_report(result, args, os.path.join(args.out, "report.html"))
        say(f"wrote {args.out}/simulation.json, simulation.png and report.html (the dashboard's views of the run)")
    emit(summary, args.json)
    return 0


def write_report(result, args, path: str) -> None:
    """The simulated run as the dashboard page, one HTML file."""
    from autotune.history import write_report

    info = {"title": f"selftune simulate {args.workload}", "model": f"cost model {args.cost_model}", "task": "embed",
            "slo_seconds": args.slo, "autotune": result.decide_calls > 0, "policy": args.policy}
    write_report(path, info, result.arrival, result.done, ~result.rejected, result.knob_changes, max(result.end_time, 1.0), result.decisions)


def _report_simulation(s: dict) -> None:
    lat = s["latency_seconds"]
    say(f"{s['requests']} requests over {s['duration_seconds']:.0f} s simulated in {s['wall_seconds']:.2f} s ({s['policy']})")
    say(f"  throughput {s['throughput']:.2f}/s   goodput {s['goodput']:.2f}/s   SLO {s['slo_seconds']} s attained {s['slo_attainment']:.1%}   rejected {s['rejected']}")
    say(f"  latency p50 {lat['p50']:.3f}  p95 {lat['p95']:.3f}  p99 {lat['p99']:.3f}  mean {lat['mean']:.3f} s")
    say(f"  batches {s['batches']} (mean size {s['mean_batch_size']:.2f})   core-seconds {s['core_seconds']:.0f}   knob changes {s['changes']}   final {s['final_knobs']}")


# ---- tune ----------------------------------------------------------------------------------


def run_tune(args) -> int:
    from autotune.offline.tuner import (
        DEFAULT_STATIC_GRID,
        get_path,
        oracle,
        progress_bar,
        static_grid,
        tune_policy,
        write_knobs,
        write_policy,
    )

    from autotune.offline.gen_cli import GEN_STATIC_GRID

    try:
        with open(shipped.resolve(args.config, shipped.TUNE_CONFIG), encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
        policy_path = str(shipped.resolve(args.policy or config.get("policy", STATIC_POLICY), shipped.POLICY))
        with open(policy_path, encoding="utf-8") as f:
            spec = yaml.safe_load(f)
    except OSError as exc:
        print(f"selftune tune: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    problem, knobs, search = _tune_problem(args, config, spec)
    objective = problem.objective
    method = args.method or search.get("method", "differential_evolution")
    started = time.perf_counter()
    grid = config.get("static_grid") or (GEN_STATIC_GRID if config.get("task") == "generate" else None)
    with progress_bar(len(static_grid(grid or DEFAULT_STATIC_GRID, knobs, problem.sim)), "static oracle") as bar:
        best_static = oracle(problem, grid, bar)
    result: dict = {"objective": objective, "policy": policy_path, "oracle": {k: v for k, v in best_static.items() if k != "grid"}}
    out = args.out or config.get("out", "tune-out")
    os.makedirs(out, exist_ok=True)
    name = os.path.splitext(os.path.basename(policy_path))[0]
    header = f"tuned by `selftune tune --config {args.config}` for {objective}"
    if spec.get("kind") == "static":
        path = os.path.join(out, f"{name}-knobs.yaml")
        write_knobs(best_static["knobs"], path, f"{header}\nbest static knobs (oracle): {objective} {best_static['score']:.4g}")
        write_policy(spec, os.path.join(out, f"{name}-tuned.yaml"), f"{header}\nstatic: the knobs are in {path} (server config `concurrency:`)")
        result.update(tuned_policy=os.path.join(out, f"{name}-tuned.yaml"), knobs_file=path, score=best_static["score"])
    else:
        with progress_bar(None, f"tuning {spec.get('kind')}") as bar:
            tuned = tune_policy(problem, method, int(search.get("maxiter", 10)), int(search.get("popsize", 5)), int(search.get("seed", 0)), bar)
        path = os.path.join(out, f"{name}-tuned.yaml")
        write_policy(tuned["spec"], path, f"{header}: {tuned['score']:.4g} (shipped parameters {tuned['baseline_score']:.4g}; best static {best_static['score']:.4g})")
        result.update(tuned_policy=path, score=tuned["score"], baseline_score=tuned["baseline_score"], evaluations=tuned["evaluations"], params={p: get_path(tuned["spec"], p) for p in problem.space})
    result["wall_seconds"] = round(time.perf_counter() - started, 2)
    with open(os.path.join(out, "tune.json"), "w", encoding="utf-8") as f:
        json.dump({**result, "oracle_grid": best_static["grid"]}, f, indent=1, default=jsonable)
    _report_tune(result)
    emit(result, args.json)
    return 0


def _tune_problem(args, config: dict, spec: dict):
    """The tune config's simulator, workloads, cost model and search space as one Problem."""
    from autotune.offline.tuner import Problem

    objective = args.objective or config.get("objective", "goodput")
    search = config.get("search", {}) or {}
    sim = config.get("simulator", {}) or {}
    defaults = argparse.Namespace(knobs="", ttft=2.0, itl=0.25, cores=None, max_inflight_batches=INFLIGHT_BATCHES, startup_seconds=1.0, max_queued_requests=512, queue_timeout=None, interval=2.0, cooldown=4.0)
    for key, value in sim.items():
        if not hasattr(defaults, key) or key in ("knobs", "ttft", "itl"):
            raise SystemExit(f"{args.config}: simulator.{key}: unknown; allowed: {', '.join(k for k in vars(defaults) if k not in ('knobs', 'ttft', 'itl'))}")
        setattr(defaults, key, value)
    if config.get("task", "embed") == "generate":
        from autotune.offline.gen_cli import gen_tune_problem

        problem, knobs = gen_tune_problem(config, spec, objective, defaults)
        return problem, knobs, search
    knobs = Knobs(**config.get("knobs", {}))
    try:  # the tune config's `dtype`: the model.dtype of the server being tuned for
        dtype = config.get("dtype", "auto")
        cost_model = load_checked_cost_model(config.get("cost_model") or default_cost_model(dtype), dtype)
    except ValueError as exc:
        raise SystemExit(f"{args.config}: {exc}") from None
    problem = Problem(
        spec=spec,
        workloads=[load_workload(w) for w in config.get("workloads", [])],
        cost_model=cost_model,
        sim=sim_config(defaults, float(config.get("slo_seconds", 0.5)), knobs, serving=cost_model.serving),
        objective=objective,
        space=search.get("params", {}) or {},
    )
    if not problem.workloads:
        raise SystemExit(f"{args.config}: workloads: give at least one")
    return problem, knobs, search


def _report_tune(r: dict) -> None:
    o = r["oracle"]
    say(f"objective: {r['objective']}   ({r['wall_seconds']:.1f} s)")
    if "baseline_score" in r:
        say(f"  tuned {r['policy']}: {r['score']:.4g} (shipped parameters: {r['baseline_score']:.4g}) -> {r['tuned_policy']}")
        say(f"  parameters: {r['params']}")
    say(f"  best static (oracle): {o['score']:.4g} with {o['knobs']}")
    say(f"    goodput {o['metrics']['goodput']:.3f}/s, attainment {o['metrics']['slo_attainment']:.1%}, p99 {o['metrics']['p99']:.3f} s")


# ---- validate ------------------------------------------------------------------------------


def run_validate(args) -> int:
    import dataclasses

    from autotune.offline.validate import calibrate, plot, table, validate
    from autotune.bench.workloads import poisson

    args.cost_model = args.cost_model or default_cost_model(args.dtype)
    try:
        cost_model = load_checked_cost_model(args.cost_model, args.dtype)
        policy = str(shipped.resolve(args.policy, shipped.POLICY)) if args.policy else None
        config = sim_config(args, args.slo, serving=cost_model.serving)
        low, _, high = args.length.partition("-")
        length = (int(low), int(high)) if high else int(low)
        if args.workload:
            workloads = [(spec, load_workload(spec)) for spec in args.workload]
        else:
            rates = [float(r) for r in args.rates.split(",")]
            workloads = [(f"poisson {r:g}/s", poisson(r, args.seconds, length, seed=i)) for i, r in enumerate(rates)]
    except (ValueError, OSError) as exc:
        print(f"selftune validate: {exc}", file=sys.stderr)
        return 2
    if args.calibrate:
        light, busy = poisson(30.0, 15.0, length, seed=99), poisson(args.calibrate_rate, 15.0, length, seed=98)
        serving = calibrate(config.knobs, args.model, light, busy, cost_model, config.cores, say, args.dtype)
        cost_model = dataclasses.replace(cost_model, serving=serving)
        # A shipped cost model is never rewritten: it may live inside an installed package.
        target = CALIBRATED_COST_MODEL if args.cost_model.startswith(shipped.BUILTIN) else args.cost_model
        cost_model.save(target)
        say(f"wrote the serving costs into {target}")
        config = sim_config(args, args.slo, serving=serving)
    rows = validate(workloads, config.knobs, policy, cost_model, config, args.model, args.slo, say, args.dtype)
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "validate.json"), "w", encoding="utf-8") as f:
            json.dump({"knobs": config.knobs.as_dict(), "policy": args.policy, "cost_model": args.cost_model, "serving": cost_model.serving, "rows": rows}, f, indent=1, default=jsonable)
        with open(os.path.join(args.out, "validate.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        plot(rows, os.path.join(args.out, "validate.png"))
        say(f"wrote {args.out}/validate.json, validate.md and validate.png")
    emit({"knobs": config.knobs.as_dict(), "policy": args.policy, "rows": rows}, args.json)
    return 0
