"""What `engine.stats()` returns: counters and per-worker state, as plain dataclasses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import Knobs


@dataclass(slots=True)
class Counters:
    """Monotonic totals since the engine started."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    batches: int = 0
    items: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    generated_tokens: int = 0
    requeued_items: int = 0
    workers_started: int = 0
    worker_deaths: int = 0

    def copy(self) -> "Counters":
        return dataclasses.replace(self)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    worker_id: int
    pid: int | None
    state: str
    load: int
    """Batches (embeddings) or sequences (generation) it holds now."""
    queued_items: int
    batches: int
    items: int
    busy_seconds: float
    """Time spent in the model, as the worker measured it."""
    age_seconds: float


@dataclass(frozen=True, slots=True)
class EngineStats:
    knobs: Knobs
    queue_depth: int
    """Items waiting in the batcher."""
    oldest_wait_seconds: float
    pending_requests: int
    ready_workers: int
    workers: tuple[WorkerStats, ...]
    counters: Counters

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
