"""`selftune bench`: multiprocess, multithread, hybrid, autotuned and oracle on the same load.

    selftune bench --quick --out bench-out          # all modes, reduced (< 5 min on 2 cores)
    selftune bench --out bench-out                  # the full table (< 15 min on 2 cores)
    selftune bench --modes autotuned,static:process_count=2,max_batch_size=64
    selftune bench --workload "onoff:on_rate=150,off_rate=5,on_seconds=30,off_seconds=60,duration=270,length=16-64"
    selftune bench --url http://127.0.0.1:8000      # the capacity of a server already running
    selftune bench --inputs-per-request 32          # indexing clients: 32 texts per request (req/s and sentences/s)
    selftune bench --task generate --quick          # streamed text generation (autotune/bench/gen_cli.py)

Progress goes to stderr; the table to stdout (and with --out to bench.md, bench.json, the
plots and requests.csv with every request); with --json the last stdout line is the JSON.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

from autotune.bench import report
from autotune.bench.capacity import LadderConfig
from autotune.bench.limit import limit_at_batch
from autotune.bench.modes import STANDARD_MODES, Mode, describe, mode, oracle_candidates, parse_grid
from autotune.bench.runner import (
    CapacityPlan,
    ModeResult,
    RunLog,
    as_dict,
    capacity,
    new_request_log,
    oracle_sweep,
    replay,
    run_mode,
)
from autotune.output import jsonable


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="compare concurrency modes (and autotuning) on the same load, measured")
    b.add_argument("--modes", default=",".join(STANDARD_MODES), help=f"comma-separated: {', '.join(STANDARD_MODES)}, default, static:KNOBS, autotuned:KNOBS; any as MODE@SERVED (float32, bfloat16, torch, onnxruntime) to serve that instead of auto's choice")
    b.add_argument("--url", help="measure this running server (capacity, or --workload) instead of starting modes")
    b.add_argument("--workload", help="replay this workload spec (autotune/bench/workloads.py) against every mode instead of the rate ladder")
    b.add_argument("--grid", help="static knob grid, e.g. 'process_count=1,2;threads_per_process=1,2;max_batch_size=4,16,64': "
                   "the oracle's sweep (capacity) or, with --workload, one replay per combination (the oracle is the best)")
    b.add_argument("--task", choices=("embed", "generate"), default="embed", help="embeddings (the default) or streamed text generation")
    b.add_argument("--model", help="default: builtin:minilm (embed), builtin:smollm2 (generate)")
    b.add_argument("--policy", help="policy file for the autotuned modes (default: configs/policies/default.yaml)")
    b.add_argument("--inputs-per-request", type=int, default=1, metavar="N",
                   help="texts per request of the rate ladder (indexing clients send 32-256); QPS is reported as requests/s and sentences/s, "
                   "the limit compared in sentences/s")
    b.add_argument("--words", default="8-48", help="MIN-MAX: words per input text of the rate ladder and the limit (uniform)")
    b.add_argument("--slo", type=float, default=0.5, help="p99 latency objective, seconds")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--quick", action="store_true", help="fewer rates, shorter steps: all modes in under 5 minutes")
    b.add_argument("--start-rate", type=float, help="first rate of the ladder (default: 0.35 × the limit)")
    b.add_argument("--no-limit", action="store_true", help="skip the in-process limit row")
    b.add_argument("--no-generator-check", action="store_true", help="skip the load generator's own capacity check")
    b.add_argument("--out", help="directory for bench.md, bench.json, the PNG plots and requests.csv")
    b.add_argument("--json", action="store_true")
    b.add_argument("--step-seconds", type=float, help="length of one rate step (default: embed 6 quick / 12, generate 15 quick / 30; generate: the limit's cells with prefill run 2/3 of it)")
    g = b.add_argument_group("generate", "with --task generate")
    g.add_argument("--ttft-slo", type=float, default=2.0, help="time-to-first-token p99 objective, seconds")
    g.add_argument("--queue-timeout", type=float, metavar="SECONDS", help="every server's limits.queue_timeout_seconds: a request "
                   "still waiting for a worker after this is refused (429) and never runs (default: off)")
    g.add_argument("--itl-slo", type=float, default=0.25, help="inter-token latency p99 objective, seconds")
    g.add_argument("--max-output-tokens", type=int, help="output lengths clipped to this (default 64 quick / 128)")
    g.add_argument("--max-prompt-tokens", type=int, help="prompt lengths clipped to this and to the model's context (default 256 quick / 512)")
    g.add_argument("--trace", default="tests/fixtures/traces/azure_llm_conv_2023_first120s.csv",
                   help="CSV with ContextTokens and GeneratedTokens columns: the prompt and output lengths drawn")
    g.add_argument("--stop-at-eos", action="store_true", help="let outputs end at EOS instead of sending ignore_eos (for servers that "
                   "refuse it, e.g. transformers serve; greedy, so every server makes the same outputs)")
    g.add_argument("--api", choices=("completions", "chat"), default="completions", help="POST /v1/completions (exact prompt lengths) or /v1/chat/completions")
    b.set_defaults(run=run_bench)


def run_bench(args) -> int:
    if args.task == "generate":
        from autotune.bench.gen_cli import run_generate_bench

        return run_generate_bench(args)
    args.model = args.model or "builtin:minilm"
    return run_embed_bench(args)


def start_bench(args, parse):
    """What `selftune bench` starts with, for either task: (say, the start time, the usable cores,
    `parse(args, cores)`, the output directory, the machine); None once it has said what is wrong
    with the arguments."""
    started = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    cores = len(os.sched_getaffinity(0))
    try:
        parsed = parse(args, cores)
    except ValueError as exc:
        print(f"selftune bench: {exc}", file=sys.stderr)
        return None
    out = args.out or tempfile.mkdtemp(prefix="selftune-bench-")
    os.makedirs(out, exist_ok=True)
    from autotune.bench.machine import machine_info

    machine = machine_info()
    say(f"machine: {machine['cpu']}, {cores} usable cores, {machine['ram_gib']} GiB")
    return say, started, cores, parsed, out, machine


def run_embed_bench(args) -> int:
    from autotune.bench.inputs import sentences

    start = start_bench(args, _parse)
    if start is None:
        return 2
    say, started, cores, (names, modes, grid, words, workload), out, machine = start
    texts = sentences(max(512, 16 * args.inputs_per_request), *words, seed=args.seed)  # at least 16 distinct requests
    limit = None if args.no_limit or args.url or workload is not None else measure_limit_row(args, texts, cores, say)
    plan = _capacity_plan(args, limit)
    csv_file, writer = new_request_log(os.path.join(out, "requests.csv"))
    logs: dict[str, RunLog] = {}
    oracle_rows: list[dict] = []
    try:
        if args.url:
            results = [_run_external(args, plan, texts, workload, writer, logs, say)]
        else:
            results, oracle_rows = _run_modes(args, names, modes, grid, cores, limit, plan, texts, workload, writer, logs, say)
    finally:
        csv_file.close()
    generator = None if args.no_generator_check or workload is not None else _generator_check(results, texts, args.seed, args.inputs_per_request, say)

    table = report.workload_table(results) if workload is not None else report.capacity_table(results, limit, args.slo, args.inputs_per_request)
    summary = {
        "machine": {**machine, "usable_cores": cores},
        "model": args.model,
        "slo_seconds": args.slo,
        "seed": args.seed,
        "words": list(words), "inputs_per_request": args.inputs_per_request, "quick": args.quick, "workload": args.workload,
        "plan": {"step_seconds": plan.step_seconds, "min_judged": plan.min_judged, "settle": plan.settle, "ladder_start": plan.ladder.start, "factor": plan.ladder.factor},
        "limit": limit,
        "modes": [as_dict(r) for r in results],
        "oracle_sweep": oracle_rows,
        "generator_check": generator,
        "seconds": round(time.monotonic() - started, 1),
    }
    summary["verdicts"] = verdicts(results, limit) if workload is None else report.workload_verdicts(results)
    write_outputs(out, summary, table, results, logs, args.slo, workload is not None)
    return finish_bench(args, summary, table, out, say)


def finish_bench(args, summary: dict, table: str, out: str, say) -> int:
    """What `selftune bench` ends with, for either task: the table and verdicts on stdout, where
    the outputs went, and with --json the summary as the last line."""
    print(table)
    for line in summary["verdicts"]:
        print(line)
    say(f"done in {summary['seconds']:.0f} s; outputs in {out}")
    if args.json:
        print(json.dumps(summary, default=jsonable))
    return 0


def _parse(args, cores: int):
    """(mode names, their Modes, the oracle's grid, sentence words, workload); ValueError names what is wrong."""
    names = split_modes(args.modes)
    modes = {n: mode(n, cores) for n in names if n != "oracle"}
    grid = parse_grid(args.grid, cores) if args.grid else None
    words = parse_words(args.words)
    if args.inputs_per_request < 1:
        raise ValueError(f"--inputs-per-request: {args.inputs_per_request} (needs a whole number >= 1)")
    if args.inputs_per_request > 1 and args.workload:
        raise ValueError("--inputs-per-request: only for the rate ladder; a --workload's arrivals are one input each")
    workload = None
    if args.workload:
        from autotune.bench.workloads import from_spec

        workload = from_spec(args.workload)
    return names, modes, grid, words, workload


def _capacity_plan(args, limit: dict | None) -> CapacityPlan:
    n = args.inputs_per_request
    start = args.start_rate or (0.35 * limit["sentences_per_second"] if limit else 20.0) / n  # rates are requests/s
    return CapacityPlan(
        ladder=LadderConfig(start=start, factor=1.4 if args.quick else 1.25, refine=1 if args.quick else 2, min_rate=0.5 / n),
        step_seconds=args.step_seconds or (6.0 if args.quick else 12.0),
        min_judged=100 if args.quick else 200,
        settle=1 / 3,
        warmup_seconds=4.0 if args.quick else 8.0,
        slo=args.slo,
        seed=args.seed,
        inputs_per_request=n,
    )


def _run_external(args, plan: CapacityPlan, texts: list[str], workload, writer, logs: dict, say) -> ModeResult:
    """The capacity (or the workload's run) of a server already running at --url."""
    log = RunLog(args.url.rstrip("/"))
    result = ModeResult("external", args.url, {}, {}, inputs_per_request=plan.inputs_per_request)
    if workload is not None:
        result.workload = replay(log, workload, args.slo, "external", say, writer)
    else:
        result.max_qps, steps = capacity(log.url, None, log, plan, texts, "external", say, writer)
        result.steps = [s.as_dict() for s in steps]
        result.at_max = next((s.as_dict() for s in steps if s.passed and s.offered == result.max_qps), None)
    result.timeline = log.rows
    result.final_knobs = result.timeline[-1] if result.timeline else {}
    logs["external"] = log
    log.close()
    return result


def _run_modes(args, names, modes, grid, cores, limit, plan, texts, workload, writer, logs: dict, say) -> tuple[list[ModeResult], list[dict]]:
    """Each mode on its own server, one after another; the oracle sweeps the static grid first."""
    results: list[ModeResult] = []
    oracle_rows: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        if workload is not None and grid:
            names = [n for n in names if n != "oracle"] + [f"static:{_knob_text(k)}" for k in grid]
            modes.update({n: mode(n, cores) for n in names if n not in modes})
        for name in names:
            if name == "oracle":
                fixed = [r.max_qps for r in results if r.max_qps]
                probe = 1.1 * max(fixed) if fixed else 0.65 * (limit["sentences_per_second"] if limit else 150.0) / plan.inputs_per_request
                best, oracle_rows = oracle_sweep(grid or oracle_candidates(cores, args.quick), args.model, probe, 5.0 if args.quick else 8.0, args.slo, texts, args.seed, say,
                                                 plan.inputs_per_request)
                m = Mode("oracle", best, description="best of the static sweep: " + describe(best))
            else:
                m = modes[name]
            result, log = run_mode(
                m, args.model, workdir, say, args.slo, plan=None if workload is not None else plan, texts=texts,
                workload=workload, writer=writer, policy=args.policy,
            )
            results.append(result)
            logs[name] = log
    return results, oracle_rows


def _generator_check(results: list[ModeResult], texts: list[str], seed: int, inputs: int, say) -> dict:
    """Can the load generator itself send 3 × the best mode's rate? (Else the numbers are its.)"""
    from autotune.bench.echo import generator_check
    from autotune.bench.runner import embed_body

    best_qps = max((r.max_qps for r in results), default=0.0)
    rate = max(3 * best_qps, 50.0 / inputs)
    say(f"generator check: {rate:.0f} req/s (3 × the best mode) against an endpoint that answers at once")
    generator = generator_check(rate, 5.0, embed_body(texts, seed, inputs)(0))
    say(f"generator: {generator['achieved']:.0f} of {rate:.0f} req/s, send lag p99 {generator['lag_p99_ms']:.1f} ms, "
        f"{generator['generator_cpu_cores']:.2f} cores")
    return generator


def parse_words(text: str) -> tuple[int, int]:
    """`8-48` -> (8, 48); `32` -> (32, 32)."""
    low, _, high = text.partition("-")
    try:
        words = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"--words: {text!r} is not MIN-MAX (whole numbers of words, e.g. 8-48)") from None
    if not 1 <= words[0] <= words[1]:
        raise ValueError(f"--words: {text!r} needs 1 <= MIN <= MAX")
    return words


def split_modes(text: str) -> list[str]:
    """`autotuned,static:process_count=2,max_batch_size=64,hybrid` -> the three modes (a part
    with `=` but no `:` continues the knobs of the mode before it)."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and names:
            names[-1] += "," + part
        else:
            names.append(part)
    return names


def measure_limit_row(args, texts: list[str], cores: int, say) -> dict:
    """The limit as the JSON carries it: the served backend's figures at the top level (what
    every ratio divides by), fp32's under "float32", and the server's dtype choice."""
    from autotune.bench.limit import measure_limit
    from engine.config import EngineConfig
    from engine.model_source import resolve_model

    source = resolve_model(args.model, EngineConfig().cache_dir)
    say(f"limit: {source.name} in-process (tokenize + forward + pool), no server; the served dtype and fp32")
    limits = measure_limit(source.path, texts, cores, duration=1.0 if args.quick else 2.0, say=say)
    best = limits.best
    say(f"limit: {best.sentences_per_second:.0f} sentences/s ({best.dtype}, {best.processes} × {best.threads}, batch {best.batch_size}); "
        f"fp32 {limits.float32.sentences_per_second:.0f}/s")
    choice = {k: v for k, v in limits.choice.items()
              if k in ("requested", "dtype", "backend", "mode", "reason", "min_cosine", "bf16_speedup", "onnxruntime_speedup")}
    return {**best.as_dict(), "backend": limits.choice.get("backend", "torch"), "mode": limits.choice.get("mode"), "choice": choice, "float32": limits.float32.as_dict()}


def verdicts(results: list[ModeResult], limit: dict | None) -> list[str]:
    """The comparisons the table exists for, in words."""
    lines = []
    best = max(results, key=lambda r: r.max_qps, default=None)
    if best is not None and limit:
        served = best.max_sentences_per_second  # the limit is sentences/s; a request may carry many
        rate = f"{best.max_qps:.0f} req/s" if best.inputs_per_request == 1 else f"{best.max_qps:.1f} req/s × {best.inputs_per_request} = {served:.0f} sentences/s"
        lines.append(f"best served mode {best.mode}: {rate} = {served / limit['sentences_per_second']:.2f} × limit ({limit['sentences_per_second']:.0f}/s{_backend(limit)})")
        if best.dtype and limit.get("dtype") and best.dtype != limit["dtype"]:  # each server's zygote probes on its own
            lines.append(f"note: {best.mode}'s server served {best.dtype}, the limit is {limit['dtype']}'s: its start-up probe chose otherwise")
        fp32 = limit.get("float32")
        if fp32 and fp32["sentences_per_second"] != limit["sentences_per_second"]:
            lines.append(f"fp32 limit {fp32['sentences_per_second']:.0f}/s: the served backend's limit is {limit['sentences_per_second'] / fp32['sentences_per_second']:.2f} × it; "
                         f"best served = {served / fp32['sentences_per_second']:.2f} × the fp32 limit")
        batch = (best.at_max or {}).get("batch_items", math.nan)
        if math.isfinite(batch):
            at_batch = limit_at_batch(limit["table"], batch)
            lines.append(
                f"at the batch size it ran at that rate ({batch:.1f} items per forward), the in-process limit is "
                f"{at_batch:.0f}/s: {served / at_batch:.2f} × that"
            )
    return lines + report.tuned_verdicts(results, lambda qps: f"{qps:.0f}", _gap)


def _backend(limit: dict) -> str:
    """`, bfloat16 bf16-mixed, the server's choice` for a limit that says its backend (older JSON does not)."""
    if "dtype" not in limit:
        return ""
    mode = f" ({limit['mode']})" if limit.get("mode") else ""
    return f", {limit['dtype']}{mode}: the backend the server serves"


def _gap(tuned: ModeResult, fixed: ModeResult, oracle: ModeResult | None) -> str:
    """How a fixed mode the autotuned one is not ahead of compares: both figures, the gap, the
    p99s at a shared max QPS, and whether the fixed mode is the configuration the oracle chose
    (tuned for this load, then, by the sweep)."""
    text = f"{tuned.max_qps:.0f} vs {fixed.max_qps:.0f}, {tuned.max_qps / max(fixed.max_qps, 1e-9) - 1:+.0%}"
    p99s = [(r.at_max or {}).get("p99") for r in (tuned, fixed)]
    if tuned.max_qps == fixed.max_qps and None not in p99s:
        text += f"; p99 there {p99s[0] * 1000:.0f} vs {p99s[1] * 1000:.0f} ms"
    if oracle is not None and oracle.start_knobs == fixed.start_knobs:
        text += "; the oracle's sweep chose this configuration"
    return text


def _knob_text(k) -> str:
    return ",".join(f"{name}={getattr(k, name)}" for name in ("process_count", "threads_per_process", "max_batch_size", "batch_timeout"))


def write_outputs(out: str, summary: dict, table: str, results: list[ModeResult], logs: dict, slo: float, is_workload: bool) -> None:
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(summary, f, indent=1, default=jsonable)
    with open(os.path.join(out, "bench.md"), "w") as f:
        m = summary["machine"]
        f.write(f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['ram_gib']} GiB; torch {m['torch']}; model {summary['model']}\n\n")
        f.write(table + "\n\n" + "\n".join(f"- {v}" for v in summary["verdicts"]) + "\n")
        g = summary.get("generator_check")
        if g:
            f.write(f"- load generator against an endpoint that answers at once: {g['achieved']:.0f} of {g['offered']:.0f} req/s offered, "
                    f"send lag p99 {g['lag_p99_ms']:.1f} ms, {g['generator_cpu_cores']:.2f} cores\n")
    if not is_workload:
        report.plot_curves(results, slo, os.path.join(out, "latency-throughput.png"), summary.get("limit"), summary.get("inputs_per_request", 1))
    for r in results:
        if r.mode.startswith("autotuned") or is_workload:
            name = r.mode.replace(":", "-").replace(",", "_").replace("=", "")
            report.plot_mode_timeline(r, logs[r.mode], slo, os.path.join(out, f"timeline-{name}.png"))
            report.write_mode_report(r, logs[r.mode], slo, summary["model"], os.path.join(out, f"report-{name}.html"))
