"""The physical limit: raw in-process throughput of the model, with no server in the way.

Tokenize + forward + pool (EmbeddingRunner) in spawned child processes, `processes` of them
running at once with `threads` torch threads each, at several batch sizes. The caller's
process never imports torch, so its own memory stays that of a client.

The limit is the backend the server would serve (`model.dtype`/`model.backend: auto` decide it in a
child through the zygote's own loading code: the native-bf16 check, the probe, the choice), and fp32
is measured beside it in the same sweep, layout by layout, so the two are comparable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import numpy as np

from engine.onnx_embedding import served_name


def child_setup(threads: int):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return torch


def load_runner(path: str, served: str = "float32", threads: int = 1):
    """The worker's runner for `served` as the zygote loads it: torch `float32`, `bfloat16`
    (mixed: Linear weights bf16 under autocast) or `onnxruntime` (engine.embedding.load_served_runner)."""
    import numpy as np

    from engine.embedding import load_served_runner
    from engine.loading import load_tokenizer

    runner = load_served_runner(path, served, threads=threads)
    tokenizer = load_tokenizer(path)
    hidden = runner.hidden_size

    def embed(texts: list[str]):
        enc = tokenizer(texts, padding=True, return_tensors="np")
        ids = enc["input_ids"].astype(np.int32, copy=False)
        lengths = tuple(int(x) for x in enc["attention_mask"].sum(axis=1))
        out = np.empty((len(texts), hidden), dtype=np.float32)
        runner.run(ids, lengths, out)
        return out, ids, lengths

    return embed, runner, hidden


def _choice_child(path: str, dtype: str, results, task: str = "embed") -> None:
    try:
        from engine.zygote import load_for_serving

        _, _, choice = load_for_serving(path, task, "cpu", dtype)
        results.put(choice)
    except BaseException as exc:  # report, never hang the parent
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def served_choice(path: str, dtype: str = "auto", task: str = "embed") -> dict:
    """What `selftune serve --task task` with `model.dtype: dtype` would serve on this CPU: the
    zygote's own loading and dtype choice (engine.zygote.load_for_serving), run in a spawned child."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_choice_child, args=(path, dtype, results, task))
    child.start()
    try:
        choice = results.get(timeout=600)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    if "error" in choice:
        raise RuntimeError(f"the dtype choice failed: {choice['error']}")
    return choice


def _limit_child(path, threads, texts, batch_sizes, duration, barrier, results, rank, dtype="float32"):
    """One process of a layout: per batch size, warm up, meet the others, run `duration` s."""
    try:
        child_setup(threads)
        embed, _, _ = load_runner(path, dtype, threads)
        embed(texts[:2])
        out = {}
        cursor = 0
        for bs in batch_sizes:
            warm_until = time.perf_counter() + min(0.5, duration / 3)
            while time.perf_counter() < warm_until:
                embed(texts[cursor : cursor + bs] or texts[:bs])
                cursor = (cursor + bs) % (len(texts) - bs)
            barrier.wait(timeout=120)
            done = 0
            started = time.perf_counter()
            end = started + duration
            while True:
                embed(texts[cursor : cursor + bs])
                cursor = (cursor + bs) % (len(texts) - bs)
                done += bs
                now = time.perf_counter()
                if now >= end:
                    break
            out[bs] = (done, now - started)
        results.put((rank, out))
    except BaseException as exc:  # report, never hang the parent
        barrier.abort()  # the others would wait for this one forever
        results.put((rank, {"error": repr(exc)}))


def run_layout(ctx, path, processes, threads, texts, batch_sizes, duration, dtype: str = "float32") -> dict[int, float]:
    """Sentences/s per batch size for `processes` concurrent processes x `threads` threads."""
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_limit_child, args=(path, threads, texts, batch_sizes, duration, barrier, results, r, dtype))
        for r in range(processes)
    ]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, out = results.get(timeout=600)
        if "error" in out:
            raise RuntimeError(f"limit child {rank} ({dtype}) failed: {out['error']}")
        got[rank] = out
    for p in procs:
        p.join()
    return {bs: sum(got[r][bs][0] / got[r][bs][1] for r in got) for bs in batch_sizes}


@dataclass(frozen=True, slots=True)
class Limit:
    sentences_per_second: float
    """The best cell of the sweep, measured again for three times as long (interleaved with the other backend's)."""
    processes: int
    threads: int
    batch_size: int
    table: dict[str, dict[int, float]]
    """Sentences/s per layout ("PxT") and batch size."""
    swept: float
    """The sweep's own figure for the best cell: the largest of many short, noisy measurements,
    so biased upwards (on this VM cells 2 s apart have differed by a third)."""
    dtype: str = "float32"
    """What the forward ran as (engine.onnx_embedding.served_name): float32, bfloat16 (mixed
    precision, as the server loads it) or onnxruntime (fp32)."""

    def as_dict(self) -> dict:
        return {"sentences_per_second": self.sentences_per_second, "swept": self.swept, "processes": self.processes,
                "threads": self.threads, "batch_size": self.batch_size, "dtype": self.dtype,
                "table": {k: {str(b): v for b, v in t.items()} for k, t in self.table.items()}}


@dataclass(frozen=True, slots=True)
class Limits:
    best: Limit
    """The limit: the backend the server would serve (`choice`), at its best layout and batch."""
    float32: Limit
    """fp32 in the same sweep (the same object as `best` when the server would serve fp32)."""
    choice: dict
    """engine.embedding.decide_dtype's answer for the requested model.dtype on this CPU."""


def limit_at_batch(table: dict[str, dict[int, float]], batch: float) -> float:
    """Sentences/s of the best layout at `batch` items per forward, linear between measured sizes.

    What the in-process forward gives at the batch size a served mode actually ran: under a
    latency SLO the server cannot wait for the large batches the plain limit is measured at.
    """
    best = 0.0
    for row in table.values():
        by_size = sorted((int(b), v) for b, v in row.items())  # keys are ints, or strings once read from JSON
        best = max(best, float(np.interp(batch, [b for b, _ in by_size], [v for _, v in by_size])))
    return best


def measure_limit(path: str, texts: list[str], cores: int, batch_sizes=(1, 8, 16, 32, 64), duration: float = 2.0,
                  say=lambda msg: None, dtype: str = "auto") -> Limits:
    """The best throughput over the layouts that fill the cores (1 × cores, cores × 1) and batch
    sizes, for the dtype the server would serve and for fp32, layout by layout in alternating
    order (this VM drifts within minutes); each winning cell is measured again, so one lucky
    short run does not set the limit."""
    ctx = mp.get_context("spawn")
    choice = served_choice(path, dtype)
    served = served_name(choice)
    say(f"limit: the server would serve {served} ({choice.get('mode')}: {choice['reason']})")
    dtypes = [served] if served == "float32" else [served, "float32"]
    layouts = [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]
    tables: dict[str, dict[str, dict[int, float]]] = {d: {} for d in dtypes}
    for i, (processes, threads) in enumerate(layouts):
        name = f"{processes}x{threads}"
        for d in dtypes if i % 2 == 0 else dtypes[::-1]:
            tables[d][name] = run_layout(ctx, path, processes, threads, texts, batch_sizes, duration, d)
            say(f"limit {name} {d}: " + "  ".join(f"batch {bs}: {v:.0f}/s" for bs, v in tables[d][name].items()))
    limits = _confirm(ctx, path, texts, tables, duration, say)
    return Limits(best=limits[served], float32=limits["float32"], choice=choice)


def _confirm(ctx, path: str, texts: list[str], tables: dict, duration: float, say) -> dict[str, Limit]:
    """Each dtype's best cell measured again for 3 × `duration` in all, in two halves taken in
    turn (A B, B A): the VM drifts within minutes, so the backends share its good and bad spells;
    the figure is the mean of the halves."""
    cells = {d: max(((n, b) for n in t for b in t[n]), key=lambda k: t[k[0]][k[1]]) for d, t in tables.items()}
    halves: dict[str, list[float]] = {d: [] for d in tables}
    order = list(tables)
    for half in range(2):
        for d in order if half == 0 else order[::-1]:
            name, bs = cells[d]
            processes, threads = (int(x) for x in name.split("x"))
            halves[d].append(run_layout(ctx, path, processes, threads, texts, (bs,), 1.5 * duration, d)[bs])
    out = {}
    for d, (name, bs) in cells.items():
        processes, threads = (int(x) for x in name.split("x"))
        confirmed = sum(halves[d]) / 2
        busy = "; under half the sweep: the cores were busy with something else, the limit reads low" if confirmed < 0.5 * tables[d][name][bs] else ""
        say(f"limit {name} {d}, batch {bs}, again for {3 * duration:g} s: {confirmed:.0f}/s "
            f"(halves {halves[d][0]:.0f}, {halves[d][1]:.0f}; the sweep said {tables[d][name][bs]:.0f}/s{busy})")
        out[d] = Limit(confirmed, processes, threads, bs, tables[d], swept=tables[d][name][bs], dtype=d)
    return out
