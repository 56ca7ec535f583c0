"""TaskJobs: what the core needs from a task (embed or generate) to carry its requests.

The loop and the supervisor are the same for both tasks; how a request becomes work for a
worker, what a worker's answer means for it, and what survives a worker's death differ, and
live in one subclass per task (engine/embed_jobs.py, engine/generate_jobs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from engine import messages as m
from engine.batcher import Batch, Item
from engine.config import EngineConfig
from engine.jobs import QueueTimeout
from engine.loading import ModelInfo
from engine.scheduler import Scheduler
from engine.stats import Counters, LatencyHistograms

if TYPE_CHECKING:
    from engine.supervisor import WorkerHandle, WorkerSupervisor


class TaskJobs:
    result_type: ClassVar[type]
    """The message a worker of this task answers work with."""

    def __init__(self, config: EngineConfig, info: ModelInfo, scheduler: Scheduler, counters: Counters, latency: LatencyHistograms, supervisor: "WorkerSupervisor"):
        self.config = config
        self.info = info
        self.scheduler = scheduler
        self.counters = counters
        self.latency = latency
        self.supervisor = supervisor
        self.jobs: dict = {}
        """request_id -> the job its caller holds, until it ends."""

    def pending(self) -> int:
        return len(self.jobs)

    def send(self, handle: "WorkerHandle", batch: Batch, now: float) -> None:
        """Hand a dispatched batch to its worker."""
        raise NotImplementedError

    def on_result(self, handle: "WorkerHandle", msg) -> None:
        """A worker's answer (`result_type`)."""
        raise NotImplementedError

    def on_failed(self, handle: "WorkerHandle", msg: m.WorkFailed) -> None:
        raise NotImplementedError

    def recover(self, handle: "WorkerHandle") -> list[Item]:
        """A worker died holding work: fail what cannot re-run, return the items that can."""
        raise NotImplementedError

    def shed(self, items: list[Item], now: float) -> None:
        """These items waited their queue limit: end their requests with `shed_error()`."""
        raise NotImplementedError

    def shed_error(self) -> QueueTimeout:
        return QueueTimeout(f"the server is over capacity: this request waited {self.config.queue_timeout:g}s "
                            "(limits.queue_timeout_seconds) for a worker and was not run; retry later")

    def cancel(self, request_id: int) -> bool:
        """Drop a request's queued work (the caller gets nothing more); False if unknown."""
        raise NotImplementedError

    def fail_all(self, error: Exception) -> None:
        """End every request with `error` (the engine is stopping or cannot go on)."""
        raise NotImplementedError
