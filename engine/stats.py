"""What `engine.stats()` returns: counters and per-worker state, as plain dataclasses."""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

import numpy as np

from engine.batcher import Batch
from engine.config import Knobs


@dataclass(slots=True)
class Counters:
    """Monotonic totals since the engine started."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    shed: int = 0
    """Requests refused after waiting their queue limit (EngineConfig.queue_timeout) for a worker."""
    batches: int = 0
    items: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    """Token slots the forward passes computed: rows × row length, padding included."""
    generated_tokens: int = 0
    batches_done: int = 0
    """Embedding batches the workers finished."""
    model_seconds: float = 0.0
    """Worker time those batches took, summed."""
    items_done: int = 0
    """Items in those batches: with the two sums below, a per-batch fit of time on size."""
    items_done_squared: int = 0
    """Σ items² over the finished batches."""
    item_model_seconds: float = 0.0
    """Σ items × worker time over the finished batches."""
    requeued_items: int = 0
    workers_started: int = 0
    worker_deaths: int = 0

    def copy(self) -> "Counters":
        return dataclasses.replace(self)

    def count_dispatch(self, batch: Batch, pack_row_tokens: int) -> None:
        """An embedding batch went to a worker (the live engine and the simulator count alike)."""
        rows, row_length = batch.shape(pack_row_tokens)
        self.batches += 1
        self.items += len(batch.items)
        self.padded_tokens += rows * row_length
        self.real_tokens += sum(item.length for item in batch.items)

    def count_batch_done(self, size: int, model_seconds: float) -> None:
        """A worker finished an embedding batch of `size` items in `model_seconds`."""
        self.batches_done += 1
        self.model_seconds += model_seconds
        self.items_done += size
        self.items_done_squared += size * size
        self.item_model_seconds += size * model_seconds


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
    cpus: str = ""
    """The CPUs it is pinned to (kernel cpulist form); empty when not pinned."""
    running_sequences: int = 0
    """Generation: sequences in its running batch, and below, waiting in it for room."""
    waiting_sequences: int = 0
    kv_tokens_used: int = 0
    """Generation: token slots its KV cache holds (rows × columns), of kv_tokens_total (0: no cap)."""
    kv_tokens_total: int = 0
    preemptions: int = 0
    max_running_sequences: int = 0
    """Generation: the live settings its last step ran with (max_batch_size, max_batch_tokens)."""
    max_batch_tokens: int = 0


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
    crash_loop: str | None = None
    """Set when workers kept dying and the engine stopped replacing them."""
    placement: dict | None = None
    """The placement plan for the current knobs (workers' CPUs, nodes, GPUs, notes)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class LatencyHistograms:
    """Cumulative latency histograms per stage, cheap enough for every request.

    Buckets are geometric (ratio 2**(1/8), about 9 % wide) from 10 µs to ~45 min, so a
    percentile read from them is within a few percent; recording is one log and one
    increment. Readers take cumulative snapshots and subtract them to get a window, the way
    Prometheus does, so nothing is ever sorted and nothing grows with traffic.
    """

    STAGES = ("preprocess", "queue", "model", "postprocess", "total", "ttft", "itl", "tpot")
    BASE = 1e-5
    PER_OCTAVE = 8
    COUNT = 8 * 28

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {stage: np.zeros(self.COUNT + 1, dtype=np.int64) for stage in self.STAGES}
        self._sums = dict.fromkeys(self.STAGES, 0.0)

    @classmethod
    def upper_bounds(cls) -> np.ndarray:
        """Upper edge of each bucket (the last one is +inf)."""
        edges = cls.BASE * 2.0 ** (np.arange(1, cls.COUNT + 1) / cls.PER_OCTAVE)
        return np.append(edges, np.inf)

    @classmethod
    def bucket(cls, seconds: float) -> int:
        if seconds <= cls.BASE:
            return 0
        index = math.ceil(math.log2(seconds / cls.BASE) * cls.PER_OCTAVE) - 1
        return min(max(index, 0), cls.COUNT)

    def record(self, stage: str, seconds: float) -> None:
        index = self.bucket(seconds)
        with self._lock:
            self._counts[stage][index] += 1
            self._sums[stage] += seconds

    def snapshot(self) -> dict[str, tuple[np.ndarray, float]]:
        """stage -> (cumulative bucket counts, sum of seconds); copies, safe to keep."""
        with self._lock:
            return {stage: (counts.copy(), self._sums[stage]) for stage, counts in self._counts.items()}
