"""The bench's outputs: the table (terminal and Markdown), the JSON, and the PNG plots."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from autotune.bench.runner import ModeResult, RunLog, knob_changes
from autotune.controller import without_holds


def tuned_verdicts(results: list[ModeResult], rate: Callable[[float], str], gap: Callable[[ModeResult, ModeResult, ModeResult | None], str]) -> list[str]:
    """The autotuned modes against the oracle and against each fixed mode, in words (embeddings
    and generation alike): `rate` writes a max QPS, `gap` a fixed mode the tuned one is not ahead of."""
    by = {r.mode: r for r in results}
    tuned = [r for r in results if r.mode.startswith("autotuned")]
    lines = []
    if "oracle" in by:
        for r in tuned:
            lines.append(f"{r.mode} / oracle = {rate(r.max_qps)} / {rate(by['oracle'].max_qps)} = {r.max_qps / max(by['oracle'].max_qps, 1e-9):.2f}")
    fixed = [r for r in results if r.mode in ("multiprocess", "multithread", "hybrid")]
    for r in tuned if fixed else ():
        ahead = [f.mode for f in fixed if r.max_qps > f.max_qps]
        behind = [f"{f.mode} ({gap(r, f, by.get('oracle'))})" for f in fixed if r.max_qps <= f.max_qps]
        lines.append(f"{r.mode} ahead of: {', '.join(ahead) or 'none'}" + (f"; not ahead of: {', '.join(behind)}" if behind else ""))
    return lines


def workload_verdicts(results: list[ModeResult], unit: Callable[[float], str] = lambda g: f"{g:.1f}/s") -> list[str]:
    """Goodput over a replayed workload: each autotuned run against the best static run of the
    grid (the oracle, for a workload) and against each fixed mode; `unit` writes a goodput."""
    static = [r for r in results if r.mode.startswith("static:")]
    best = max(static, key=lambda r: r.workload["goodput"], default=None)
    fixed = [r for r in results if r.mode in ("multiprocess", "multithread", "hybrid")]
    lines = []
    if best is not None:
        lines.append(f"best static ({len(static)} runs): {best.mode}: goodput {unit(best.workload['goodput'])}")
    for r in results:
        if r.mode.startswith("autotuned"):
            g = r.workload["goodput"]
            line = f"{r.mode}: goodput {unit(g)}"
            if best is not None:
                line += f" = {g / max(best.workload['goodput'], 1e-9):.0%} of the best static"
            line += "".join(f"; {f.mode} {unit(f.workload['goodput'])} ({g / max(f.workload['goodput'], 1e-9):.2f} ×)" for f in fixed)
            lines.append(line)
    return lines


def _ms(seconds) -> str:
    return "–" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1000:.0f}"


def capacity_table(results: list[ModeResult], limit: dict | None, slo: float, inputs: int = 1) -> str:
    """Markdown: per mode max QPS within the SLO and, at that rate, latency, memory, CPU. With
    `inputs` texts per request, QPS is requests/s with sentences/s beside it."""
    qps = f"max QPS (p99 ≤ {slo * 1000:.0f} ms)" + (f": req/s (sentences/s, {inputs} per request)" if inputs > 1 else "")
    lines = [
        f"| mode | configuration | {qps} | mean latency (ms) | p99 latency (ms) | items per forward | memory, all processes (MiB) | CPU (cores) | knobs at the end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        at = r.at_max or {}
        knobs = r.final_knobs
        end = f"{knobs.get('process_count')}×{knobs.get('threads_per_process')}, batch {knobs.get('max_batch_size')}, {knobs.get('batch_timeout', 0) * 1000:.3g} ms" if knobs else ""
        cpu = at.get("cpu_cores")
        batch = at.get("batch_items", math.nan)
        lines.append(
            f"| {r.mode} | {r.description}{f', {r.dtype}' if r.dtype else ''} | {_rate(r.max_qps, inputs)} | {_ms(at.get('mean'))} | {_ms(at.get('p99'))} | "
            f"{f'{batch:.1f}' if math.isfinite(batch) else '–'} | {r.memory_mib:.0f} | {'–' if cpu is None else f'{cpu:.2f}'} | {end} |"
        )
    if limit is not None:
        lines += limit_rows(limit, inputs)
    return "\n".join(lines)


def _rate(requests_per_second: float, inputs: int) -> str:
    if inputs == 1:
        return f"**{requests_per_second:.0f}**"
    return f"**{requests_per_second:.1f}** ({requests_per_second * inputs:.0f})"


def limit_rows(limit: dict, inputs: int = 1) -> list[str]:
    """The limit row (the backend the server serves) and, when that is not fp32, fp32's beside it."""
    fp32 = limit.get("float32")
    mode = f" ({limit['mode']})" if limit.get("mode") else ""
    rows = [("limit", limit, f"{limit.get('dtype', 'float32')}{mode}, the backend the server serves")]
    if fp32 and fp32.get("dtype") != limit.get("dtype"):
        rows.append(("limit, fp32", fp32, "float32, for comparison"))
    return [
        f"| {name} | in-process, no server, {what}: {row['processes']} × {row['threads']}, batch {row['batch_size']} | "
        f"{_rate(row['sentences_per_second'] / inputs, inputs)} | | | {row['batch_size']} | | | |"
        for name, row, what in rows
    ]


def workload_table(results: list[ModeResult]) -> str:
    """Markdown: per mode goodput, throughput, attainment and latency over a replayed workload."""
    lines = [
        "| mode | configuration | goodput (req/s within SLO) | throughput (req/s) | within SLO | p50 (ms) | p99 (ms) | memory (MiB) | knobs at the end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        w = r.workload or {}
        lat = w.get("latency_seconds", {})
        k = r.final_knobs
        end = f"{k.get('process_count')}×{k.get('threads_per_process')}, batch {k.get('max_batch_size')}, {k.get('batch_timeout', 0) * 1000:g} ms" if k else ""
        lines.append(
            f"| {r.mode} | {r.description} | **{w.get('goodput', 0):.1f}** | {w.get('throughput', 0):.1f} | "
            f"{w.get('slo_attainment', 0):.1%} | {_ms(lat.get('p50'))} | {_ms(lat.get('p99'))} | {r.memory_mib:.0f} | {end} |"
        )
    return "\n".join(lines)


def plot_curves(results: list[ModeResult], slo: float, path: str, limit: dict | None = None, inputs: int = 1) -> None:
    """Latency–throughput curves: p99 (solid) and mean (dotted) against the offered rate, per
    mode; the limit (the served backend's) and the fp32 limit as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, r in enumerate(results):
        steps = sorted(r.steps, key=lambda s: s["offered"])
        if not steps:
            continue
        x = [s["offered"] for s in steps]
        color = f"C{i % 10}"
        ax.plot(x, [s["p99"] * 1000 for s in steps], "o-", color=color, label=f"{r.mode} p99 (max {r.max_qps:.3g}/s)")
        ax.plot(x, [s["mean"] * 1000 for s in steps], ":", color=color, lw=1)
    ax.axhline(slo * 1000, color="k", ls="--", lw=0.8, label="SLO")
    for row, style, name in _limit_lines(limit):
        sps = row["sentences_per_second"]
        ax.axvline(sps / inputs, color="k", ls=style, lw=1, label=f"{name}: {sps:.0f} sentences/s" + (f" = {sps / inputs:.1f} req/s" if inputs > 1 else ""))
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s, Poisson)" + (f", {inputs} texts per request" if inputs > 1 else ""))
    ax.set_ylabel("latency (ms): p99 solid, mean dotted")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _limit_lines(limit: dict | None) -> list[tuple[dict, str, str]]:
    if not limit:
        return []
    lines = [(limit, "-.", f"limit, {limit.get('dtype', 'float32')}")]
    fp32 = limit.get("float32")
    if fp32 and fp32.get("dtype") != limit.get("dtype"):
        lines.append((fp32, ":", "limit, float32"))
    return lines


def _requests(log: RunLog) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival, done, ok) per request of a mode's run."""
    return (np.array([a for a, _, _ in log.requests]), np.array([d for _, d, _ in log.requests]),
            np.array([o for _, _, o in log.requests], dtype=bool))


def plot_mode_timeline(result: ModeResult, log: RunLog, slo: float, path: str, task: str = "embed") -> None:
    """One mode's latency (generation: time to first token) and knobs over its whole run."""
    from autotune.plots import timeline

    if not log.requests or not result.timeline:
        return
    arrival, done, ok = _requests(log)
    timeline(arrival, done, ok, knob_changes(result.timeline), slo, path, "seconds since the first request", bins=200, task=task)


def write_mode_report(result: ModeResult, log: RunLog, slo: float, model: str, path: str, task: str = "embed") -> None:
    """One mode's run as the dashboard page (one HTML file): the knob changes from the /stats
    polls, marked with the policy's own reasons where the server gave them (GET /admin/decisions).
    (Generation: the log's request times are TTFTs, `slo` the TTFT objective.)"""
    from autotune.history import write_report

    if not log.requests or not result.timeline:
        return
    arrival, done, ok = _requests(log)
    changes = knob_changes(result.timeline)
    decisions = result.decisions
    if not without_holds(decisions):  # no reasons from the server: the changes the polls saw
        decisions = decisions + [{"at": t, "outcome": "applied", "reason": "the knobs changed (seen in /stats)", "old": old.as_dict(), "new": new.as_dict()}
                                 for (_, old), (t, new) in zip(changes, changes[1:])]
    end = float(max(np.nanmax(done), arrival.max()))
    info = {"title": f"selftune bench: {result.mode}", "model": model, "task": task, "slo_seconds": slo,
            "autotune": result.mode.startswith("autotuned"), "policy": result.mode}
    write_report(path, info, arrival, done, ok, changes, end, decisions)
