"""Observation: the one immutable snapshot that the controller and the policies read.

Taken every `interval` by the sampler in the front process. Everything in it is a plain
value (seconds, rates per second, fractions 0..1, bytes), so policies stay pure functions of
it and the simulator can build the same type from its virtual clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from monitors.gpu import GpuReport
from monitors.host import HostSample
from monitors.topology import NumaNode


@dataclass(frozen=True, slots=True)
class Latency:
    """Percentiles over the window, in seconds; None where nothing finished in it."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    count: int = 0


@dataclass(frozen=True, slots=True)
class BatchTimes:
    """Sums over the batches that finished in the window, enough for a least-squares fit of a
    batch's worker time on its size from the batches themselves: sizes vary from batch to
    batch even when their mean over the window hardly moves."""

    batches: int = 0
    items: float = 0.0
    """Σ size."""
    items_squared: float = 0.0
    """Σ size²."""
    seconds: float = 0.0
    """Σ worker time."""
    item_seconds: float = 0.0
    """Σ size × worker time."""


@dataclass(frozen=True, slots=True)
class Load:
    """What the traffic is doing, over the sampler's window."""

    arrival_rate: float = 0.0
    """Requests per second admitted to the engine."""
    completion_rate: float = 0.0
    rejected_rate: float = 0.0
    """Requests per second answered 429 (admission full)."""
    shed_rate: float = 0.0
    """Requests per second admitted (in arrival_rate) and then refused, a 429, after waiting
    limits.queue_timeout_seconds for a worker."""
    timed_out_rate: float = 0.0
    failed_rate: float = 0.0
    queue_depth: int = 0
    """Items waiting in the batcher now."""
    queue_wait: float = 0.0
    """Seconds the oldest waiting item has waited, now."""
    pending_requests: int = 0
    latency: dict[str, Latency] = field(default_factory=dict)
    """Stage -> percentiles: total, queue, preprocess, model, postprocess; for generation ttft, itl
    (every gap between two tokens) and tpot (each finished request's mean gap, time per output token)."""
    batch_size: float = 0.0
    """Mean items per batch over the window."""
    batch_fill: float = 1.0
    """Real tokens / padded tokens over the window (1.0 = no padding)."""
    batch_seconds: float = 0.0
    """Mean worker time of one batch over the window (0 when none finished). With batch_size it
    is a per-batch pair; latency["model"] is per request, so it weighs a batch by its items and,
    when batch sizes mix, pairs a small mean size with the time of the big batches."""
    batch_times: BatchTimes = field(default_factory=BatchTimes)
    items_rate: float = 0.0
    input_tokens_per_second: float = 0.0
    """Input tokens dispatched to the workers per second (embedding inputs, or generation prompts)."""
    tokens_per_second: float = 0.0
    """Generated tokens per second (generation only)."""


@dataclass(frozen=True, slots=True)
class WorkerObservation:
    worker_id: int
    pid: int | None
    state: str
    busy_fraction: float
    """Share of the window the worker spent in the model (0..1)."""
    load: int
    batch_size: float = 0.0
    """Mean items per batch this worker ran over the window (0 when it ran none)."""
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    uss_bytes: int | None = None
    threads: int | None = None
    cpus: tuple[int, ...] = ()
    numa_pages: dict[int, int] = field(default_factory=dict)
    """NUMA node -> pages of the worker's memory on it."""
    running_sequences: int = 0
    """Generation: sequences in its running batch now, and below, waiting in it for KV room."""
    waiting_sequences: int = 0
    kv_tokens_used: int = 0
    """Generation: KV token slots held now, of kv_tokens_total (its live cap; 0: no cap)."""
    kv_tokens_total: int = 0
    preemptions: int = 0
    """Generation: sequences preempted (to be recomputed) within the window."""


@dataclass(frozen=True, slots=True)
class Observation:
    time: float
    """The sampler's `now` (monotonic seconds)."""
    window_seconds: float
    load: Load
    workers: tuple[WorkerObservation, ...] = ()
    host: HostSample | None = None
    numa: tuple[NumaNode, ...] = ()
    gpu: GpuReport | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def busy_fraction(self) -> float:
        """Mean busy fraction of the ready workers (0 with none)."""
        ready = [w.busy_fraction for w in self.workers if w.state == "ready"]
        return sum(ready) / len(ready) if ready else 0.0
