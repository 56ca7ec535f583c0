"""`selftune profile --task generate`: time the real runner's steps and fit the generation cost model.

In this process, the model loaded through the server's own path, in the dtype the server would
serve (`model.dtype: auto`: the zygote's own choice, made in a spawned child), the engine's
`GenerationRunner` stepped as a worker steps it: prefill-only steps of one prompt of n tokens,
and decode-only steps of r rows over about c columns, at each thread count. Every point is the
median of a few repeats (this machine's speed drifts; other processes share it). The full grid
reaches 512-token prompts and contexts; longer ones are extrapolated by the fit.
"""

from __future__ import annotations

import platform
import statistics
import time

from autotune.offline.gen_costmodel import GenCostModel, fit

QUICK = {"threads": (1, 2), "prefill": (8, 32, 96, 192), "rows": (1, 4, 8), "columns": (16, 64, 160), "repeats": 3}
FULL = {"threads": (1, 2), "prefill": (16, 64, 256, 512), "rows": (1, 4, 16), "columns": (32, 256, 512), "repeats": 2}


def profile_generation(model_spec: str, grid: dict = QUICK, say=lambda msg: None, save_to: str | None = None, dtype: str = "auto") -> GenCostModel:
    """The fitted model; with `save_to`, saved after each thread count too (a long profile cut
    short keeps what it measured)."""
    import torch

    from autotune.bench.limit import served_choice
    from engine.config import EngineConfig
    from engine.generation import GenerationRunner
    from engine.loading import load_model, load_tokenizer, model_info
    from engine.model_source import resolve_model

    source = resolve_model(model_spec, EngineConfig().cache_dir)
    info = model_info(source.path, load_tokenizer(source.path), "generate")
    choice = served_choice(source.path, dtype, task="generate")
    say(f"profiling in {choice['dtype']} (model.dtype {dtype}: {choice['reason']})")
    model = load_model(source.path, "generate", getattr(torch, choice["dtype"]))
    limit = info.max_length
    points = []
    for threads in grid["threads"]:
        torch.set_num_threads(threads)
        for n in (n for n in grid["prefill"] if n < limit):
            seconds = _median(grid["repeats"], lambda: _prefill_step(GenerationRunner(model, ()), n))
            points.append([threads, n, 0, 0, seconds])
        for rows in grid["rows"]:
            for columns in (c for c in grid["columns"] if c + 8 < limit):
                seconds = _decode_step(GenerationRunner(model, (), max_running=rows), rows, columns, grid["repeats"])
                points.append([threads, 0, rows, columns, seconds])
        say(f"profiled {threads} thread(s): {len(points)} points")
        machine = f"{platform.processor() or platform.machine()}, {len(_cpus())} cpus"
        model_so_far = GenCostModel(fit(points), limit, info.kv_values_per_token, model_spec, machine, points, choice["dtype"], choice)
        if save_to:
            model_so_far.save(save_to)
    return model_so_far


def _prefill_step(runner, n: int) -> float:
    from engine.generation import SamplingParams, SequenceRequest

    runner.add(SequenceRequest(0, tuple(range(100, 100 + n)), SamplingParams(max_tokens=1, temperature=0.0)))
    started = time.perf_counter()
    runner.step()
    return time.perf_counter() - started


def _decode_step(runner, rows: int, columns: int, repeats: int) -> float:
    """The median of `repeats` decode steps of `rows` rows about `columns` wide (prefilled once,
    untimed; each step widens them by one column, nothing next to hundreds)."""
    from engine.generation import SamplingParams, SequenceRequest

    params = SamplingParams(max_tokens=repeats + 3, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        runner.add(SequenceRequest(i, tuple(range(100, 100 + columns)), params))
    runner.step()
    runner.step()  # the first decode step, untimed: caches warm

    def one() -> float:
        started = time.perf_counter()
        runner.step()
        return time.perf_counter() - started

    return _median(repeats, one)


def _median(repeats: int, measure) -> float:
    return statistics.median(measure() for _ in range(repeats))


def _cpus():
    import os

    return os.sched_getaffinity(0)
