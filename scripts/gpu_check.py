#!/usr/bin/env python3
"""The GPU check (issue #24): one run, under 8 minutes, of everything selftune should do on CUDA.

    python scripts/gpu_check.py --out DIR            # on a GPU machine, after scripts/gpu_check.sh --install
    python scripts/gpu_check.py --dry-run --out DIR  # anywhere: the steps that need no CUDA, the rest skipped

Usually started through scripts/gpu_check.sh, which installs first. Each step has a time
budget (STEPS); its outcome, seconds and details go to DIR/gpu_check.json and
DIR/gpu_check.md, and a summary table is printed. Exit status 0 when no step failed. Only the
standard library is imported before the steps run, so a missing package is reported, not raised.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpucheck import report, serve_steps, steps  # noqa: E402  (stdlib-only at import time)
from gpucheck.common import Fail, Skip, say  # noqa: E402

GPU_RUN_LIMIT_S = 480


@dataclass(frozen=True)
class StepSpec:
    name: str
    budget_s: int
    run: Callable
    needs_cuda: bool
    what: str
    dry_run_only: bool = False


STEPS = (
    StepSpec("environment", 20, steps.environment, False, "python, torch, CUDA, driver, GPU, NVML; every package present"),
    StepSpec("fork_probe", 25, steps.fork_probe, True, "a process forked after the zygote's device/dtype choice can use CUDA"),
    StepSpec("references", 40, steps.references, False, "CPU references: MiniLM embeddings, SmolLM2 greedy tokens"),
    StepSpec("configs", 10, steps.configs, False, "temporary server configs, accepted by `selftune config show`"),
    StepSpec("gpu_tests", 110, steps.gpu_tests, False, "pytest -m gpu tests/test_gpu.py (they skip without CUDA)"),
    StepSpec("cpu_standin", 90, serve_steps.cpu_standin, False,
             "dry run only: the serve checks' plumbing on CPU servers", dry_run_only=True),
    StepSpec("serve_embed_wpg1", 35, serve_steps.serve_embed_wpg1, True,
             "serve embeddings on CUDA, 1 worker: cosine >= 0.999, /metrics /stats GPU figures"),
    StepSpec("serve_embed_wpg2", 35, serve_steps.serve_embed_wpg2, True,
             "serve embeddings on CUDA, 2 workers on one GPU (workers_per_gpu 2): the same checks"),
    StepSpec("serve_generate", 35, serve_steps.serve_generate, True,
             "serve SmolLM2 on CUDA (float32): greedy tokens equal the CPU's, GPU figures"),
    StepSpec("stream_generate", 35, serve_steps.stream_generate, True,
             "32 concurrent streamed chats x 2 on CUDA (dtype auto): TTFT, ITL, output tokens/s"),
    StepSpec("bench_embed", 80, serve_steps.bench_embed, True,
             "selftune bench --quick --url against an autotuned CUDA embedding server"),
)
REPORT_BUDGET_S = 5
INSTALL_BUDGET_S = 45


def budgets(dry_run: bool) -> dict:
    """The budgets that add up: a GPU run (the wrapper's install and the report included, the
    dry-run-only stand-in not), a dry run (no CUDA step), and the one of this run's mode."""
    gpu = INSTALL_BUDGET_S + REPORT_BUDGET_S + sum(s.budget_s for s in STEPS if not s.dry_run_only)
    dry = REPORT_BUDGET_S + sum(s.budget_s for s in STEPS if not s.needs_cuda)
    return {"budget_gpu_run_s": gpu, "budget_dry_run_s": dry, "budget_run_s": dry if dry_run else gpu}


def record(spec: StepSpec, status: str, seconds: float, details: dict | None = None, reason: str | None = None,
           error: str | None = None) -> dict:
    out = {"name": spec.name, "status": status, "seconds": round(seconds, 1), "budget_s": spec.budget_s,
           "over_budget": seconds > spec.budget_s, "needs_cuda": spec.needs_cuda, "dry_run_only": spec.dry_run_only,
           "what": spec.what, "details": details or {}}
    if reason:
        out["reason"] = reason
    if error:
        out["error"] = error
    return out


def skip_reason(spec: StepSpec, ctx: steps.Context, args, started: float) -> str | None:
    if spec.name == "environment":
        return None  # always: the others need what it finds
    if ctx.blocked:
        return ctx.blocked
    if args.only and spec.name not in args.only:
        return "not in --only"
    if spec.name in args.skip:
        return "--skip"
    if spec.dry_run_only and not ctx.dry_run:
        return "only in a dry run: the CUDA steps exercise the same plumbing"
    if spec.needs_cuda and ctx.dry_run:
        return "dry run: needs CUDA"
    if spec.needs_cuda and not ctx.cuda:
        return "CUDA is not available (see the environment step)"
    if time.monotonic() - started + spec.budget_s > args.time_limit:
        return f"not enough time left within --time-limit {args.time_limit:.0f} s"
    return None


def run_step(spec: StepSpec, ctx: steps.Context, index: int) -> dict:
    say(f"step {index}/{len(STEPS)} {spec.name}: {spec.what} (budget {spec.budget_s} s)")
    ctx.budget = spec.budget_s
    t0 = time.monotonic()
    try:
        details = spec.run(ctx)
        outcome = record(spec, "passed", time.monotonic() - t0, details)
    except Skip as exc:
        outcome = record(spec, "skipped", time.monotonic() - t0, reason=str(exc))
    except Fail as exc:
        outcome = record(spec, "failed", time.monotonic() - t0, exc.details, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a broken step is a failed step; the others still run
        outcome = record(spec, "failed", time.monotonic() - t0, {"traceback": traceback.format_exc()[-4000:]},
                         error=f"{type(exc).__name__}: {exc}")
    over = " (over budget)" if outcome["over_budget"] else ""
    say(f"  {spec.name}: {outcome['status']} in {outcome['seconds']:.1f} s{over}"
        + (f": {outcome['error']}" if outcome.get("error") else ""))
    return outcome


def install_record(path: str | None) -> dict:
    """The wrapper's install step, as it recorded it (skipped when the driver runs alone)."""
    spec = StepSpec("install", INSTALL_BUDGET_S, None, False, "scripts/gpu_check.sh: the README's setup with a GPU torch")
    if not path:
        return record(spec, "skipped", 0.0, reason="not asked (scripts/gpu_check.sh --install or --offline-wheelhouse DIR)")
    with open(path) as f:
        data = json.load(f)
    return record(spec, data["status"], float(data["seconds"]), {"summary": data.get("details", "")},
                  reason=data.get("reason"), error=data.get("error"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="steps and budgets (seconds):\n" + "\n".join(
                                    f"  {s.name:<18} {s.budget_s:>4}  {'[CUDA] ' if s.needs_cuda else ''}{s.what}" for s in STEPS))
    p.add_argument("--dry-run", action="store_true", help="run only what needs no CUDA; CUDA steps are skipped")
    p.add_argument("--out", help="output folder (default: a new temporary folder)")
    p.add_argument("--only", default="", help="comma-separated step names to run (the others are skipped; environment always runs)")
    p.add_argument("--skip", default="", help="comma-separated step names to skip")
    p.add_argument("--time-limit", type=float, default=500.0,
                   help="skip a step whose budget would end past this many seconds of the driver's run (default 500)")
    p.add_argument("--timeout-factor", type=float, default=1.25, help="a step is stopped at budget x this")
    p.add_argument("--bench-start-rate", type=float, default=400.0, help="first rate of the bench ladder, req/s")
    p.add_argument("--install-record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = {s for s in args.only.split(",") if s}
    args.skip = {s for s in args.skip.split(",") if s}
    unknown = (args.only | args.skip) - {s.name for s in STEPS}
    if unknown:
        p.error(f"unknown step(s) {sorted(unknown)}; steps: {', '.join(s.name for s in STEPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="selftune-gpu-check-"))
    os.makedirs(out, exist_ok=True)
    ctx = steps.Context(out=out, dry_run=args.dry_run, bench_start_rate=args.bench_start_rate, timeout_factor=args.timeout_factor)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    started = time.monotonic()
    say(f"GPU check ({'dry run' if args.dry_run else 'GPU run'}), outputs in {out}")
    records = [install_record(args.install_record)]
    for index, spec in enumerate(STEPS, 1):
        reason = skip_reason(spec, ctx, args, started)
        if reason:
            say(f"step {index}/{len(STEPS)} {spec.name}: skipped ({reason})")
            records.append(record(spec, "skipped", 0.0, reason=reason))
        else:
            records.append(run_step(spec, ctx, index))
            if spec.name == "environment" and records[-1]["status"] == "failed":
                ctx.blocked = "the environment step failed (see it)"
    report_spec = StepSpec("report", REPORT_BUDGET_S, None, False, "gpu_check.json, gpu_check.md, the summary table")
    records.append(record(report_spec, "passed", 0.0, {"summary": "this file"}))
    counts = {k: sum(r["status"] == k for r in records) for k in ("passed", "failed", "skipped")}
    summary = {"mode": "dry-run" if args.dry_run else "gpu", "started_at": started_at, "out": out,
               "seconds": round(time.monotonic() - started, 1), "limit_s": GPU_RUN_LIMIT_S, **budgets(args.dry_run),
               "workaround": ctx.workaround, "counts": counts, "ok": counts["failed"] == 0,
               "headline": report.headline(records), "steps": records}
    json_path, md_path = report.write(out, summary)
    print(report.table(records))
    print(f"\n{'ok' if summary['ok'] else 'FAILED'}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped in {summary['seconds']:.0f} s; {json_path}, {md_path}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
