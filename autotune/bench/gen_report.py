"""The generation bench's outputs: the table (Markdown), the verdicts, and the PNG curves."""

from __future__ import annotations

import math

from autotune.bench.limit import limit_at_batch
from autotune.bench.report import tuned_verdicts
from autotune.bench.runner import ModeResult


def _ms(seconds) -> str:
    return "–" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1000:.0f}"


def _num(value, fmt: str = ".1f") -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, fmt)


def generation_table(results: list[ModeResult], limit: dict | None, ttft_slo: float, itl_slo: float) -> str:
    """Markdown: per mode the highest rate within both objectives and, at that rate, tokens/s, goodput, latencies."""
    lines = [
        f"| mode | configuration | max req/s (TTFT p99 ≤ {ttft_slo:g} s, ITL p99 ≤ {itl_slo * 1000:.0f} ms) | output tokens/s | goodput (req/s) | "
        "TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | end-to-end mean / p99 (ms) | running sequences | memory (MiB) | CPU (cores) | knobs at the end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        at = r.at_max or {}
        k = r.final_knobs
        end = f"{k.get('process_count')}×{k.get('threads_per_process')}, batch {k.get('max_batch_size')}" if k else ""
        lines.append(
            f"| {r.mode} | {r.description} | **{r.max_qps:.2f}** | {_num(at.get('output_tokens_per_s'))} | {_num(at.get('goodput'), '.2f')} | "
            f"{_ms(at.get('ttft_p50'))} / {_ms(at.get('ttft_p99'))} | {_ms(at.get('itl_p50'))} / {_ms(at.get('itl_p99'))} | "
            f"{_ms(at.get('e2e_mean'))} / {_ms(at.get('e2e_p99'))} | {_num(at.get('running'))} | {r.memory_mib:.0f} | {_num(at.get('cpu_cores'), '.2f')} | {end} |"
        )
    if limit is not None:
        layout = f"{limit['processes']}x{limit['threads']}"
        cells = ", ".join(f"B={b}: {v:.0f}" for b, v in limit["table"][layout].items())
        lines.append(
            f"| limit | in-process decode, no server: {limit['processes']} × {limit['threads']}, {limit.get('dtype', 'float32')}, prompts of {limit['prompt_tokens']} tokens ({cells} tok/s) | | "
            f"**{limit['tokens_per_second']:.1f}** (B={limit['batch_size']}) | | | | | {limit['batch_size']} | | | |"
        )
        if limit.get("with_prefill"):
            lines.append(_with_prefill_row(limit["with_prefill"]))
    return "\n".join(lines)


def _with_prefill_row(mix: dict[str, dict[int, float]]) -> str:
    """The limit serving the bench's own requests (prefill included): each layout's cells, the best one in bold."""
    layout, batch = max(((n, b) for n in mix for b in mix[n]), key=lambda k: mix[k[0]][k[1]])
    cells = "; ".join(f"{n.replace('x', ' × ')}: " + ", ".join(f"B={b}: {v:.0f}" for b, v in row.items()) for n, row in mix.items())
    return (f"| limit, these requests | in-process, prefill included (whole prompts per step), no server ({cells} tok/s) | | "
            f"**{mix[layout][batch]:.1f}** ({layout.replace('x', ' × ')}, B={batch}) | | | | | {batch} | | | |")


def generation_workload_table(results: list[ModeResult], ttft_slo: float, itl_slo: float) -> str:
    """Markdown: per mode, over one replayed workload, goodput within both objectives and the latencies behind it."""
    lines = [
        f"| mode | configuration | goodput (req/s, TTFT ≤ {ttft_slo:g} s and time per token ≤ {itl_slo * 1000:.0f} ms) | requests | failed / cut | "
        "output tokens/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | end-to-end mean / p99 (ms) | running sequences | CPU (cores) | knobs at the end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        w = r.workload or {}
        k = r.final_knobs
        end = f"{k.get('process_count')}×{k.get('threads_per_process')}, batch {k.get('max_batch_size')}, chunk {k.get('max_batch_tokens')}" if k else ""
        lines.append(
            f"| {r.mode} | {r.description} | **{_num(w.get('goodput'), '.3f')}** | {w.get('judged', 0)} | {w.get('failed', 0)} / {w.get('cut', 0)} | "
            f"{_num(w.get('output_tokens_per_s'))} | {_ms(w.get('ttft_p50'))} / {_ms(w.get('ttft_p99'))} | {_ms(w.get('itl_p50'))} / {_ms(w.get('itl_p99'))} | "
            f"{_ms(w.get('e2e_mean'))} / {_ms(w.get('e2e_p99'))} | {_num(w.get('running'))} | {_num(w.get('cpu_cores'), '.2f')} | {end} |"
        )
    return "\n".join(lines)


def generation_verdicts(results: list[ModeResult], limit: dict | None) -> list[str]:
    """The comparisons the table exists for, in words: the best mode against the limit at the
    running batch it served, and the autotuned runs against the oracle and the fixed modes."""
    lines = []
    served = [r for r in results if r.at_max]
    best = max(served, key=lambda r: (r.max_qps, r.at_max["output_tokens_per_s"]), default=None)  # the highest rate; tokens/s breaks ties
    if best is not None and limit:
        tokens = best.at_max["output_tokens_per_s"]
        lines.append(f"best served mode {best.mode}: {tokens:.1f} output tokens/s at {best.max_qps:.2f} req/s = "
                     f"{tokens / limit['tokens_per_second']:.2f} × the limit ({limit['tokens_per_second']:.1f} tok/s at B={limit['batch_size']})")
        running = best.at_max.get("running", math.nan)
        if running is not None and math.isfinite(running) and running > 0:
            at_batch = limit_at_batch(limit["table"], running)
            lines.append(f"at the batch it ran ({running:.1f} sequences running, all workers), the in-process decode limit is "
                         f"{at_batch:.1f} tok/s: {tokens / at_batch:.2f} × that")
            if limit.get("with_prefill"):
                served = limit_at_batch(limit["with_prefill"], running)
                lines.append(f"serving these requests in-process at that batch (prefill included), the limit is {served:.1f} tok/s: "
                             f"{tokens / served:.2f} × that")
    lines += tuned_verdicts(results, lambda qps: f"{qps:.2f} req/s", lambda r, f, _oracle: f"{r.max_qps:.2f} vs {f.max_qps:.2f} req/s")
    return lines


def plot_generation_curves(results: list[ModeResult], ttft_slo: float, itl_slo: float, path: str) -> None:
    """Three panels against the offered rate, per mode: TTFT p99, ITL p99 (objectives dashed), output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [("ttft_p99", 1000, "TTFT p99 (ms)", ttft_slo * 1000), ("itl_p99", 1000, "ITL p99 (ms)", itl_slo * 1000),
              ("output_tokens_per_s", 1, "output tokens/s", None)]
    for i, r in enumerate(results):
        steps = sorted(r.steps, key=lambda s: s["offered"])
        if not steps:
            continue
        x = [s["offered"] for s in steps]
        for ax, (key, scale, _, _) in zip(axes, panels):
            ax.plot(x, [s[key] * scale for s in steps], "o-", color=f"C{i % 10}", label=f"{r.mode} (max {r.max_qps:.2f} req/s)")
            passed = [(s["offered"], s[key] * scale) for s in steps if s["passed"]]
            if passed:  # passing steps filled, failing ones hollow
                ax.plot(*zip(*passed), "o", color=f"C{i % 10}", ms=8, mfc=f"C{i % 10}", alpha=0.5)
    for ax, (_, _, label, objective) in zip(axes, panels):
        if objective is not None:
            ax.axhline(objective, color="k", ls="--", lw=0.8, label="objective")
            ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
