"""The profiler: real forward passes on this machine over a grid, fitted into a cost model.

A point's time is the lower quartile of its batch times, and the in-process grid is measured
in `passes` rounds keeping each point's best: other work on the machine (a shared CI box, a
test suite next door) only ever adds time, and an OpenMP pool whose core is taken stalls by
hundreds of milliseconds, so the median of a short run can be wildly off; the low quantile
of repeated runs is what the machine does when it is ours.

Single-process points run in this process (torch threads set per point). Multi-process points
run in real processes started with 'spawn' (a fork after torch has run an op is unsafe): each
loads the model, then all run the same batch shape at once for a fixed wall-clock window, so
the measured time includes the slowdown of sharing the cores and the memory bus.

The forward runs in the dtype the server would serve for the requested model.dtype (auto: the
zygote's own choice, made in a child, as the bench's limit makes it), and the cost model
records it (`backend`): a bf16 profile of MiniLM is 1.5-2x faster than an fp32 one.
"""

from __future__ import annotations

import itertools
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np

from autotune.bench.limit import served_choice
from engine.onnx_embedding import served_name
from autotune.offline.costmodel import FittedCostModel, Point, fit_cost_model, predict

SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog while the server tunes itself. "


@dataclass(frozen=True, slots=True)
class Grid:
    batch_sizes: tuple[int, ...]
    lengths: tuple[int, ...]
    threads: tuple[int, ...]
    processes: tuple[int, ...]
    multi_shapes: tuple[tuple[int, int], ...]
    """(batch_size, length) measured with more than one process (a subset: they are slow)."""
    seconds_per_point: float
    """Wall-clock measuring time per point (at least 3 batches are always timed)."""
    passes: int = 2
    """Rounds over the in-process grid; each point keeps its fastest round."""


QUICK = Grid((1, 4, 16), (16, 64, 256), (1, 2), (1, 2), ((1, 16), (4, 64), (16, 64), (4, 256)), 0.2, 3)
FULL = Grid((1, 2, 4, 8, 16, 32), (16, 32, 64, 128, 256, 512), (1, 2, 4), (1, 2, 4), ((1, 16), (4, 64), (16, 16), (16, 64), (8, 128), (4, 256), (2, 512)), 1.0, 3)


def typical(times: list[float]) -> float:
    """The lower quartile: interference only adds time (see the module docstring)."""
    return float(np.percentile(times, 25))


def machine_description(model_name: str, dtype: str) -> dict:
    import torch

    cores = len(os.sched_getaffinity(0))
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": cores,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "dtype": dtype,
        "model": model_name,
        "load_average_at_start": os.getloadavg()[0],
    }


def token_ids(tokenizer, batch_size: int, length: int) -> np.ndarray:
    """A (batch_size, length) id matrix of real text tokens (every row full: no padding)."""
    ids = tokenizer(SAMPLE_TEXT * (length // 8 + 2), add_special_tokens=False)["input_ids"][:length]
    return np.tile(np.asarray(ids, np.int32), (batch_size, 1))


def time_batches(runner, tokenizer, batch_size: int, length: int, seconds: float, until: float | None = None) -> list[float]:
    """Seconds per batch, timed back to back for `seconds` (or until the clock reaches `until`)."""
    ids = token_ids(tokenizer, batch_size, length)
    out = np.zeros((batch_size, runner.hidden_size), np.float32)
    lengths = (length,) * batch_size
    stop = until if until is not None else time.perf_counter() + seconds
    times: list[float] = []
    while len(times) < 3 or time.perf_counter() < stop:
        started = time.perf_counter()
        runner.run(ids, lengths, out)
        times.append(time.perf_counter() - started)
    return times


def load_runner(model_path: str, served: str):
    """The runner for what the server serves (float32, bfloat16: mixed, or onnxruntime), loaded as it loads it."""
    from engine.embedding import load_served_runner
    from engine.loading import load_tokenizer

    return load_served_runner(model_path, served, pack_row_tokens=0), load_tokenizer(model_path)


def measure_in_process(model_path: str, dtype: str, grid: Grid, progress) -> list[Point]:
    runner, tokenizer = load_runner(model_path, dtype)
    best: dict[tuple, float] = {}
    shapes = list(itertools.product(grid.threads, grid.batch_sizes, grid.lengths))
    rng = np.random.default_rng(0)
    for _ in range(grid.passes):  # each pass in a new order, so a busy spell hits different points
        for index in rng.permutation(len(shapes)):
            threads, batch_size, length = shapes[index]
            runner.set_threads(threads)
            time_batches(runner, tokenizer, batch_size, length, 0.0)  # warm-up: first call allocates
            seconds = typical(time_batches(runner, tokenizer, batch_size, length, grid.seconds_per_point))
            key = (threads, batch_size, length)
            best[key] = min(best.get(key, np.inf), seconds)
            progress.update(1)
    return [Point(b, l, t, 1, s) for (t, b, l), s in best.items()]


def _multi_worker(model_path: str, dtype: str, shapes: list, seconds: float, barrier, results) -> None:
    """One spawned measuring process: each shape starts on the barrier, runs for `seconds`."""
    runner, tokenizer = load_runner(model_path, dtype)
    for threads, batch_size, length in shapes:
        runner.set_threads(threads)
        time_batches(runner, tokenizer, batch_size, length, 0.0)
        barrier.wait()
        times = time_batches(runner, tokenizer, batch_size, length, seconds, until=time.perf_counter() + seconds)
        results.put((threads, batch_size, length, typical(times)))
        barrier.wait()


def measure_processes(model_path: str, dtype: str, grid: Grid, processes: int, progress) -> list[Point]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    shapes = [(t, b, l) for t in grid.threads for b, l in grid.multi_shapes]
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [ctx.Process(target=_multi_worker, args=(model_path, dtype, shapes, grid.seconds_per_point * 2, barrier, results), daemon=True) for _ in range(processes)]
    for proc in procs:
        proc.start()
    measured: dict[tuple, list[float]] = {}
    try:
        for _ in range(len(shapes) * processes):
            threads, batch_size, length, seconds = results.get(timeout=600)
            measured.setdefault((threads, batch_size, length), []).append(seconds)
            if len(measured[(threads, batch_size, length)]) == processes:
                progress.update(1)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [Point(b, l, t, processes, float(np.median(v))) for (t, b, l), v in measured.items()]


def profile(model_spec: str = "builtin:minilm", dtype: str = "auto", grid: Grid = QUICK, seed: int = 0) -> FittedCostModel:
    """Measure the grid in the dtype the server would serve for model.dtype `dtype`, fit the
    cost model, return it (with the points, the held-out error and the backend)."""
    import dataclasses

    from tqdm import tqdm

    from engine.model_source import resolve_model

    source = resolve_model(model_spec, cache_dir=os.path.expanduser("~/.cache/selftune"))
    choice = served_choice(source.path, dtype)
    requested, dtype = dtype, choice["dtype"]
    backend = {"name": choice.get("backend", "torch"), "dtype": dtype, "mode": choice.get("mode"), "requested": requested, "reason": choice.get("reason"),
               "min_cosine": choice.get("min_cosine")}
    machine = machine_description(source.name, dtype)
    multi = [p for p in grid.processes if p > 1]
    total = grid.passes * len(grid.threads) * len(grid.batch_sizes) * len(grid.lengths) + len(multi) * len(grid.threads) * len(grid.multi_shapes)
    started = time.perf_counter()
    with tqdm(total=total, desc="profiling", unit="point", file=sys.stderr) as progress:
        points = measure_in_process(source.path, served_name(choice), grid, progress)
        for processes in multi:
            points += measure_processes(source.path, served_name(choice), grid, processes, progress)
    machine["profile_seconds"] = round(time.perf_counter() - started, 1)
    machine["load_average_at_end"] = os.getloadavg()[0]
    return dataclasses.replace(fit_cost_model(points, machine["cores"], machine, seed=seed), backend=backend)


def plot(model: FittedCostModel, path: str) -> None:
    """Measured vs fitted service time, one marker per (threads, processes), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cores = model.machine.get("cores") or model.fit.get("cores", 1)
    pts = model.points
    fig, ax = plt.subplots(figsize=(6, 5))
    groups = sorted({(p["threads"], p["processes"]) for p in pts})
    for threads, processes in groups:
        sel = [p for p in pts if (p["threads"], p["processes"]) == (threads, processes)]
        measured = np.array([p["seconds"] for p in sel])
        fitted = predict(
            model.coefficients(),
            np.array([p["batch_size"] for p in sel], float),
            np.array([p["padded_length"] for p in sel], float),
            np.array([threads] * len(sel), float),
            np.array([processes] * len(sel), float),
            float(cores),
        )
        ax.scatter(measured, fitted, label=f"{processes} proc × {threads} thr", s=18)
    lo = min(p["seconds"] for p in pts) / 1.5
    hi = max(p["seconds"] for p in pts) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds per batch")
    ax.set_ylabel("fitted seconds per batch")
    fit = model.fit
    ax.set_title(f"{model.machine.get('model', '')}: held-out MAPE {fit.get('heldout_mape', float('nan')):.1%}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
