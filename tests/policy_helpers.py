"""Builders shared by the policy tests: Observations, default bounds, threshold and aimd policies."""

from __future__ import annotations

import dataclasses

from engine.config import Bounds, Knobs
from monitors.observation import BatchTimes, Latency, Load, Observation, WorkerObservation
from policies.aimd import AimdParams, AimdPolicy
from policies.generate import GenerateParams, GeneratePolicy
from policies.threshold import ThresholdParams, ThresholdPolicy

BOUNDS = Bounds()
GEN_TWO_CORES = dataclasses.replace(Bounds(), process_count=(1, 2), threads_per_process=(1, 2))
GEN_START = Knobs(process_count=2, threads_per_process=1, max_batch_size=16, max_batch_tokens=256, kv_tokens=0)


def gen_decide(observation, knobs=GEN_START, **params):
    """One decision of a fresh generate policy (GenerateParams from `params`) on two cores."""
    return GeneratePolicy(GenerateParams(**params)).decide(observation, knobs, GEN_TWO_CORES)


def obs(
    t: float,
    *,
    busy: float = 0.5,
    workers: int = 2,
    ready: int | None = None,
    p99: float | None = None,
    count: int = 100,
    arrival: float = 0.0,
    completion: float | None = None,
    items_rate: float | None = None,
    batch_size: float = 0.0,
    model_mean: float | None = None,
    batch_seconds: float | None = None,
    batches: list[tuple[int, float]] | None = None,
    queue_depth: int = 0,
) -> Observation:
    """An Observation with `workers` workers (the first `ready` of them ready, all at `busy`).
    The window's finished batches are `batches` (size, seconds), or else ten of the mean size and time."""
    ready = workers if ready is None else ready
    latency = {}
    if p99 is not None:
        latency["total"] = Latency(p50=p99 / 2, p95=p99 * 0.9, p99=p99, mean=p99 / 2, count=count)
    if model_mean is not None:
        latency["model"] = Latency(p50=model_mean, p95=model_mean, p99=model_mean, mean=model_mean, count=count)
    completion = arrival if completion is None else completion
    batch_seconds = (model_mean or 0.0) if batch_seconds is None else batch_seconds
    if batches is None:
        batches = [(batch_size, batch_seconds)] * 10 if batch_size > 0 else []
    load = Load(
        arrival_rate=arrival,
        completion_rate=completion,
        items_rate=completion if items_rate is None else items_rate,
        queue_depth=queue_depth,
        latency=latency,
        batch_size=batch_size,
        batch_seconds=batch_seconds,
        batch_times=batch_times(batches),
    )
    states = ["ready"] * ready + ["starting"] * (workers - ready)
    return Observation(
        time=t,
        window_seconds=10.0,
        load=load,
        workers=tuple(WorkerObservation(i, 1000 + i, s, busy if s == "ready" else 0.0, 0) for i, s in enumerate(states)),
    )


def batch_times(batches: list[tuple[int, float]]) -> BatchTimes:
    return BatchTimes(
        batches=len(batches),
        items=sum(n for n, _ in batches),
        items_squared=sum(n * n for n, _ in batches),
        seconds=sum(s for _, s in batches),
        item_seconds=sum(n * s for n, s in batches),
    )


def threshold(**overrides) -> ThresholdPolicy:
    return ThresholdPolicy(ThresholdParams(**overrides))


def aimd(**overrides) -> AimdPolicy:
    return AimdPolicy(AimdParams(**{"slo_p99_seconds": 0.5, **overrides}))


def gen_obs(
    t: float,
    *,
    ttft: float | None = 0.5,
    itl: float | None = 0.1,
    itl_mean: float | None = None,
    tpot: float | None = None,
    tokens: int = 500,
    first_tokens: int = 20,
    held: int = 4,
    running: int | None = None,
    waiting: int = 0,
    queue_depth: int = 0,
    preemptions: int = 0,
    kv_total: int = 10_000,
    workers: int = 2,
    prompt: float = 400.0,
    arrivals: float = 2.0,
    completions: float = 2.0,
) -> Observation:
    """A generation Observation: TTFT and ITL p99s over `first_tokens` and `tokens` samples, each
    of `workers` ready workers holding `held` sequences (`running` of them in its batch); two
    requests a second of `prompt` tokens each (`arrivals` and `completions` a second counted as
    arriving and finishing). The mean inter-token gap is half the p99 unless given; `tpot`, the p99
    of `first_tokens` finished requests' mean gaps, only when given."""
    latency = {}
    if ttft is not None:
        latency["ttft"] = Latency(p50=ttft / 2, p95=ttft * 0.9, p99=ttft, mean=ttft / 2, count=first_tokens)
    if itl is not None:
        latency["itl"] = Latency(p50=itl / 2, p95=itl * 0.9, p99=itl, mean=itl / 2 if itl_mean is None else itl_mean, count=tokens)
    if tpot is not None:
        latency["tpot"] = Latency(p50=tpot * 0.8, p95=tpot * 0.95, p99=tpot, mean=tpot * 0.8, count=first_tokens)
    running = held if running is None else running
    worker = dict(running_sequences=running, waiting_sequences=waiting, kv_tokens_used=kv_total // 2, kv_tokens_total=kv_total, preemptions=preemptions)
    return Observation(
        time=t,
        window_seconds=10.0,
        load=Load(arrival_rate=arrivals, completion_rate=completions, items_rate=2.0, input_tokens_per_second=2.0 * prompt, queue_depth=queue_depth,
                  latency=latency, tokens_per_second=tokens / 10),
        workers=tuple(WorkerObservation(i, 1000 + i, "ready", 0.9, held, **worker) for i in range(workers)),
    )
