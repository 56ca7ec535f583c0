"""PNG figures shared by the simulator and the live benchmarks (matplotlib, no display needed)."""

from __future__ import annotations

import numpy as np

from engine.config import Knobs


def timeline(arrival: np.ndarray, done: np.ndarray, ok: np.ndarray, knob_changes: list[tuple[float, Knobs]], slo: float, path: str,
             xlabel: str = "seconds", bins: int = 300, end: float | None = None, task: str = "embed") -> None:
    """Latency percentiles and load over time, with the knobs beneath (one PNG).

    `arrival` and `done` are per-request times (done is ignored where `ok` is False);
    `knob_changes` is [(time, knobs)] starting with the knobs at time 0. For `task` "generate",
    `done` is the first token's time, and the batching knobs drawn are running sequences and
    prompt tokens per step (the batch timeout does not apply to decode steps).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(end if end is not None else float(np.nanmax(done[ok], initial=0.0)), 1e-9)
    edges = np.linspace(0.0, end, bins + 1)
    mids = (edges[:-1] + edges[1:]) / 2
    width = edges[1] - edges[0]
    which = np.clip(np.searchsorted(edges, done[ok], side="right") - 1, 0, bins - 1)
    latency = (done - arrival)[ok]
    p50, p99 = np.full(bins, np.nan), np.full(bins, np.nan)
    order = np.argsort(which, kind="stable")
    groups = np.split(latency[order], np.cumsum(np.bincount(which, minlength=bins))[:-1])
    for b, values in enumerate(groups):
        if len(values):
            p50[b], p99[b] = np.percentile(values, (50, 99))
    arrivals = np.histogram(arrival, edges)[0] / width
    completions = np.bincount(which, minlength=bins) / width
    times = [t for t, _ in knob_changes] + [end]
    knobs = [k for _, k in knob_changes]
    knobs.append(knobs[-1])

    fig, axes = plt.subplots(4, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3, 1.3]})
    ax = axes[0]
    ax.plot(mids, p50, lw=0.8, label="p50")
    ax.plot(mids, p99, lw=0.8, label="p99")
    ax.axhline(slo, color="k", ls="--", lw=0.8, label="SLO")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)" if task == "generate" else "latency (s)")
    ax.legend(fontsize=8, loc="upper right")
    axes[1].plot(mids, arrivals, lw=0.8, label="arrivals/s")
    axes[1].plot(mids, completions, lw=0.8, label="completions/s")
    axes[1].set_ylabel("req/s")
    axes[1].legend(fontsize=8, loc="upper right")
    _knob_panels(axes[2], axes[3], times, knobs, task)
    axes[3].set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _knob_panels(workers, batching, times: list[float], knobs: list[Knobs], task: str) -> None:
    """The layout, then the batching knobs: for generation running sequences and prompt tokens
    per step, else batch size and timeout."""
    workers.step(times, [k.process_count for k in knobs], where="post", label="process_count")
    workers.step(times, [k.threads_per_process for k in knobs], where="post", label="threads_per_process")
    workers.set_ylabel("workers")
    workers.legend(fontsize=8, loc="upper right")
    batching.step(times, [k.max_batch_size for k in knobs], where="post", label="max_batch_size")
    batching.set_ylabel("running seqs" if task == "generate" else "max batch")
    twin = batching.twinx()
    if task == "generate":
        twin.step(times, [k.max_batch_tokens for k in knobs], where="post", color="C1", label="max_batch_tokens")
        twin.set_ylabel("prompt tokens / step")
    else:
        twin.step(times, [k.batch_timeout * 1000 for k in knobs], where="post", color="C1", label="batch_timeout (ms)")
        twin.set_ylabel("timeout ms")
    batching.legend(fontsize=8, loc="upper left")
    twin.legend(fontsize=8, loc="upper right")
