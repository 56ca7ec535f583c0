"""`selftune bench --task generate`: the modes on streamed text generation, judged on TTFT and ITL.

    selftune bench --task generate --quick --modes multiprocess,autotuned --out gen-out
    selftune bench --task generate --modes static:process_count=1,threads_per_process=2,max_batch_size=32
    selftune bench --task generate --url http://127.0.0.1:8001      # a server already running
    selftune bench --task generate --quick --workload onoff:on_rate=0.8,off_rate=0.1,on_seconds=60,off_seconds=120,duration=540 \
        --modes autotuned,multiprocess,oracle                            # one replay per mode; the oracle: each static of the grid

Prompt and output lengths come from an LLM trace (--trace), clipped; the model's tokenizer
builds each prompt to its drawn length. A --workload gives the arrival times only (its token
lengths are ignored): request i is the i-th drawn prompt, as on the ladder. Outputs: the table on stdout (and with --out bench.md,
bench.json, generation-curves.png, requests.csv, the autotuned runs' timelines and reports).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time

import httpx
import numpy as np

from autotune.bench import gen_inputs, gen_report, report
from autotune.bench.capacity import LadderConfig
from autotune.bench.gen_runner import GEN_REQUEST_COLUMNS, GenPlan, GenRunLog, gen_oracle_sweep, generation_capacity, replay_generation, run_gen_mode
from autotune.bench.modes import Mode, describe, generation_candidates, mode, parse_grid
from autotune.bench.runner import ModeResult, as_dict, new_request_log
from autotune.output import jsonable

DEFAULT_MODEL = "builtin:smollm2"


def run_generate_bench(args) -> int:
    from autotune.bench.cli import finish_bench, start_bench

    start = start_bench(args, _parse)
    if start is None:
        return 2
    say, started, cores, (names, modes, grid, table, workload), out, machine = start
    model = args.model or DEFAULT_MODEL
    path, context, builder = _model(model, say)
    requests, body, pairs = _requests(args, table, context, builder, model, say)
    limit = None
    if not (args.no_limit or args.url or workload is not None):
        from autotune.bench.gen_limit import measure_generation_limit
        from autotune.bench.limit import served_choice

        choice = served_choice(path, "auto", task="generate")  # what the modes' servers serve (model.dtype: auto)
        say(f"limit: {model} in-process (GenerationRunner, {choice['dtype']}: {choice['reason']}), no server")
        limit = measure_generation_limit(path, cores, int(requests["prompt_tokens_median"]), duration=1.0 if args.quick else 2.0, say=say,
                                         dtype=choice["dtype"], pairs=pairs, mix_duration=_step_seconds(args) * 2 / 3)
    plan = _plan(args, _capacity_estimate(limit, requests), gen_inputs.path_of(args.api))
    csv_file, writer = new_request_log(os.path.join(out, "requests.csv"), GEN_REQUEST_COLUMNS)
    logs: dict[str, GenRunLog] = {}
    oracle_rows: list[dict] = []
    try:
        if args.url:
            results = [_run_external(args.url, plan, body, writer, logs, say, workload)]
        else:
            results, oracle_rows = _run_modes(args, names, modes, grid, cores, model, plan, body, writer, logs, say, workload)
    finally:
        csv_file.close()
    generator = None if args.no_generator_check or workload is not None else _generator_check(results, requests["max_output_tokens"], say)
    summary = {
        "task": "generate", "machine": {**machine, "usable_cores": cores}, "model": model, "api": args.api,
        "ttft_slo_seconds": plan.ttft_slo, "itl_slo_seconds": plan.itl_slo, "seed": args.seed, "quick": args.quick, "requests": requests,
        "workload": args.workload, "plan": {"step_seconds": plan.step_seconds, "min_judged": plan.min_judged, "settle": plan.settle, "grace": plan.grace,
                 "ladder_start": plan.ladder.start, "factor": plan.ladder.factor},
        "limit": limit, "modes": [as_dict(r) for r in results], "oracle_sweep": oracle_rows, "generator_check": generator,
        "verdicts": gen_report.generation_verdicts(results, limit) if workload is None else report.workload_verdicts(results, lambda g: f"{g:.3f} req/s"),
        "seconds": round(time.monotonic() - started, 1),
    }
    if workload is None:
        table_md = gen_report.generation_table(results, limit, plan.ttft_slo, plan.itl_slo)
    else:
        table_md = gen_report.generation_workload_table(results, plan.ttft_slo, plan.itl_slo)
    _write_outputs(out, summary, table_md, results, logs, plan)
    return finish_bench(args, summary, table_md, out, say)


def _requests(args, table, context: int, builder, model: str, say) -> tuple[dict, object, list[tuple[int, int]]]:
    """(what the requests are, for the summary; body(i), request i of every step, the same for every mode;
    their (prompt, output) lengths)."""
    max_out = min(args.max_output_tokens or (64 if args.quick else 128), context - builder.specials - 1)
    max_prompt = max(1, min(args.max_prompt_tokens or (256 if args.quick else 512), context - max_out))
    min_prompt = builder.specials + 1  # a prompt carries the tokenizer's special tokens and one token of text at least
    pairs = gen_inputs.draw_lengths(table, 256, args.seed, max_prompt, max_out, min_prompt=min_prompt)
    name = _served_name(args.url) if args.url else model
    bodies = gen_inputs.bodies(builder, pairs, name, args.api, args.seed, ignore_eos=not args.stop_at_eos)
    prompts, outputs = np.array([p for p, _ in pairs]), np.array([o for _, o in pairs])
    say(f"requests: prompts {int(prompts.min())}-{int(prompts.max())} tokens (median {int(np.median(prompts))}), "
        f"outputs {int(outputs.min())}-{int(outputs.max())} (mean {outputs.mean():.1f}), from {args.trace}")
    requests = {"trace": args.trace, "min_prompt_tokens": min_prompt, "max_prompt_tokens": max_prompt, "max_output_tokens": max_out, "pairs": len(pairs),
                "prompt_tokens_median": float(np.median(prompts)), "output_tokens_mean": float(outputs.mean())}
    return requests, lambda i: bodies[i % len(bodies)], pairs


def _parse(args, cores: int):
    """(mode names, their Modes, the oracle's grid, the trace's length table, the workload's
    arrival times or None); ValueError names what is wrong."""
    from autotune.bench.cli import split_modes

    for flag, value in (("--ttft-slo", args.ttft_slo), ("--itl-slo", args.itl_slo), ("--step-seconds", args.step_seconds),
                        ("--max-output-tokens", args.max_output_tokens), ("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--start-rate", args.start_rate), ("--queue-timeout", args.queue_timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag}: {value!r} must be a positive number")
    workload = None
    if args.workload:
        from autotune.bench.workloads import from_spec

        workload = [t for t, _ in from_spec(args.workload)]
        if not workload:
            raise ValueError(f"--workload: {args.workload!r} makes no arrivals")
    names = split_modes(args.modes)
    modes = {n: _mode(args, n, cores) for n in names if n != "oracle"}
    grid = parse_grid(args.grid, cores) if args.grid else None
    if not os.path.exists(gen_inputs.locate(args.trace)):
        raise ValueError(f"--trace: {args.trace!r} not found (a CSV with ContextTokens and GeneratedTokens columns, e.g. the Azure LLM trace)")
    try:
        table = gen_inputs.read_lengths(args.trace)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"--trace: {args.trace!r} is not an Azure LLM trace CSV ({exc})") from None
    return names, modes, grid, table, workload


def _model(spec: str, say):
    """(local directory, context length, prompt builder) of the model the bench serves (and tokenizes for)."""
    from engine.config import EngineConfig
    from engine.loading import load_tokenizer, model_info
    from engine.model_source import resolve_model

    source = resolve_model(spec, EngineConfig().cache_dir)
    tokenizer = load_tokenizer(source.path)
    context = model_info(source.path, tokenizer, "generate").max_length
    say(f"model: {source.name} ({source.path}), context {context} tokens")
    return source.path, context, gen_inputs.PromptBuilder(tokenizer)


def _served_name(url: str) -> str:
    """The first name a running server lists on /v1/models (what its requests must name)."""
    return httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]


def _capacity_estimate(limit: dict | None, requests: dict) -> float | None:
    """Requests/s the machine could serve if nothing but the limit's prefill and decode took time
    (an upper bound: no queueing, no objectives); None without a limit."""
    if not limit:
        return None
    prefill = max(v for row in limit["prefill_tokens_per_second"].values() for v in row.values())
    seconds = requests["prompt_tokens_median"] / prefill + requests["output_tokens_mean"] / limit["tokens_per_second"]
    return 1.0 / max(seconds, 1e-9)


def _step_seconds(args) -> float:
    """A rung's length; the limit's cells with prefill run two thirds of it (10 s with --quick, 20 s
    without): each holds only a few completions per running sequence, so they need long windows."""
    return args.step_seconds or (15.0 if args.quick else 30.0)


def _plan(args, capacity: float | None, path: str) -> GenPlan:
    # the ladder starts at 0.3 × the no-queueing estimate (SmolLM2 here: ~1.4 req/s estimated, its
    # first passing rate ~0.2; a failing first step costs the most, at low rates steps are longest)
    start = args.start_rate or (0.3 * capacity if capacity else 0.3)
    step = _step_seconds(args)
    return GenPlan(
        ladder=LadderConfig(start=start, factor=1.5 if args.quick else 1.3, refine=1 if args.quick else 2, min_rate=0.02),
        step_seconds=step,
        min_judged=16 if args.quick else 60,
        settle=1 / 3,
        warmup_seconds=min(step / 2, 5.0 if args.quick else 10.0),
        ttft_slo=args.ttft_slo,
        itl_slo=args.itl_slo,
        grace=args.ttft_slo + 1.0,  # a request cut before its first token has waited longer than the objective
        path=path,
        seed=args.seed,
        longest=2.0 if args.quick else 3.0,
    )


def _run_external(url: str, plan: GenPlan, body, writer, logs: dict, say, workload: list[float] | None = None) -> ModeResult:
    """The capacity (or one replay of the workload) of a generating server already running at `url`."""
    log = GenRunLog(url.rstrip("/"))
    result = ModeResult("external", url, {}, {})
    try:
        if workload is not None:
            result.workload = replay_generation(log, workload, plan, body, "external", say, writer).as_dict()
        else:
            result.max_qps, steps = generation_capacity(log.url, None, log, plan, body, "external", say, writer)
            result.steps = [s.as_dict() for s in steps]
            result.at_max = next((s.as_dict() for s in steps if s.passed and s.offered == result.max_qps), None)
    finally:
        log.close()
    result.timeline = log.rows
    result.final_knobs = log.rows[-1] if log.rows else {}
    logs["external"] = log
    return result


def _mode(args, name: str, cores: int) -> Mode:
    """The mode `name`, its server with --queue-timeout (which the table's configuration names)."""
    m = mode(name, cores)
    if args.queue_timeout is None:
        return m
    return dataclasses.replace(m, queue_timeout=args.queue_timeout, description=f"{m.description}; queue limit {args.queue_timeout:g} s")


def _run_modes(args, names, modes, grid, cores, model, plan: GenPlan, body, writer, logs: dict, say,
               workload: list[float] | None = None) -> tuple[list[ModeResult], list[dict]]:
    """Each mode on its own server, one after another; the oracle sweeps the static grid first.
    With a workload the oracle (or a --grid) is every static of the grid, each replaying it."""
    results: list[ModeResult] = []
    oracle_rows: list[dict] = []
    if workload is not None and (grid or "oracle" in names):
        statics = [f"static:{_knob_text(k)}" for k in grid or generation_candidates(cores, args.quick)]
        names = [n for n in names if n != "oracle"] + [n for n in statics if n not in names]
        modes.update({n: _mode(args, n, cores) for n in statics})
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            if name == "oracle":
                fixed = [r.max_qps for r in results if r.max_qps]
                probe = 1.1 * max(fixed) if fixed else 2 * plan.ladder.start
                candidates = grid or generation_candidates(cores, args.quick)
                best, oracle_rows = gen_oracle_sweep(candidates, model, probe, plan.step_seconds, plan, body, say, args.queue_timeout)
                m = Mode("oracle", best, description="best of the static sweep: " + describe(best), queue_timeout=args.queue_timeout)
            else:
                m = modes[name]
            result, log = run_gen_mode(m, model, workdir, say, plan, body, writer, args.policy, workload)
            results.append(result)
            logs[name] = log
    return results, oracle_rows


def _knob_text(k) -> str:
    """The knobs a generation static differs by, as a `static:` mode's text."""
    return ",".join(f"{name}={getattr(k, name)}" for name in ("process_count", "threads_per_process", "io_threads", "max_batch_size", "max_batch_tokens"))


def _generator_check(results: list[ModeResult], max_out: int, say) -> dict:
    """Can the load generator itself stream 3 × the best mode's rate? (Else the numbers are its.)"""
    from autotune.bench.echo import generator_check

    rate = max(3 * max((r.max_qps for r in results), default=0.0), 20.0)
    say(f"generator check: {rate:.0f} streamed req/s of {max_out} chunks (3 × the best mode) against an endpoint that answers at once")
    check = generator_check(rate, 5.0, json.dumps({"max_tokens": max_out, "stream": True}).encode(), stream=True)
    say(f"generator: {check['achieved']:.1f} of {rate:.0f} req/s, {check['tokens_per_second']:.0f} chunks/s, "
        f"send lag p99 {check['lag_p99_ms']:.1f} ms, {check['generator_cpu_cores']:.2f} cores")
    return check


def _write_outputs(out: str, summary: dict, table: str, results: list[ModeResult], logs: dict, plan: GenPlan) -> None:
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(summary, f, indent=1, default=jsonable)
    with open(os.path.join(out, "bench.md"), "w") as f:
        m, q = summary["machine"], summary["requests"]
        f.write(f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['ram_gib']} GiB; torch {m['torch']}; model {summary['model']}; "
                f"prompts ≤ {q['max_prompt_tokens']} tokens (median {q['prompt_tokens_median']:.0f}), outputs ≤ {q['max_output_tokens']} "
                f"(mean {q['output_tokens_mean']:.1f}), streamed" + (f"; workload {summary['workload']}" if summary["workload"] else "") + "\n\n")
        f.write(table + "\n\n" + "\n".join(f"- {v}" for v in summary["verdicts"]) + "\n")
        g = summary.get("generator_check")
        if g:
            f.write(f"- load generator against an endpoint that streams at once: {g['achieved']:.1f} of {g['offered']:.0f} req/s offered, "
                    f"{g['tokens_per_second']:.0f} chunks/s, send lag p99 {g['lag_p99_ms']:.1f} ms, {g['generator_cpu_cores']:.2f} cores\n")
    is_workload = summary["workload"] is not None
    if not is_workload:
        gen_report.plot_generation_curves(results, plan.ttft_slo, plan.itl_slo, os.path.join(out, "generation-curves.png"))
    for r in results:
        if r.mode.startswith("autotuned") or is_workload:
            name = r.mode.replace(":", "-").replace(",", "_").replace("=", "")
            report.plot_mode_timeline(r, logs[r.mode], plan.ttft_slo, os.path.join(out, f"timeline-{name}.png"), task="generate")
            report.write_mode_report(r, logs[r.mode], plan.ttft_slo, summary["model"], os.path.join(out, f"report-{name}.html"), task="generate")
