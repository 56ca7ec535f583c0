"""Builders shared by the policy tests: Observations, default bounds, threshold and aimd policies."""

from __future__ import annotations

from engine.config import Bounds
from monitors.observation import BatchTimes, Latency, Load, Observation, WorkerObservation
from policies.aimd import AimdParams, AimdPolicy
from policies.threshold import ThresholdParams, ThresholdPolicy

BOUNDS = Bounds()


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
