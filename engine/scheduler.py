"""Scheduler: batcher + router, the pure decision core that the live engine and the simulator share.

Events go in (`submit`, `batch_done`, worker joined/left), and `schedule(now)` returns the
dispatches to carry out; `next_wakeup()` says when to call it again if nothing else happens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.batcher import Batch, Batcher, Item
from engine.config import INFLIGHT_BATCHES, Knobs, Task
from engine.router import Router


@dataclass(frozen=True, slots=True)
class Dispatch:
    worker_id: int
    batch: Batch


class Scheduler:
    def __init__(self, task: Task, knobs: Knobs, max_inflight_batches: int = INFLIGHT_BATCHES):
        self.task = task
        self.max_inflight_batches = max_inflight_batches
        self.batcher = Batcher(1, 0.0)
        self.router = Router(1)
        self.configure(knobs)

    def configure(self, knobs: Knobs) -> None:
        """Apply the batching knobs; takes effect at the next `schedule`.

        Embeddings: batches of up to max_batch_size items, a few batches in flight per worker.
        Generation: sequences go one by one to workers, each running up to max_batch_size at
        once (the worker batches them continuously), so there is no timeout to wait for.
        """
        if self.task == "embed":
            self.batcher.configure(knobs.max_batch_size, knobs.batch_timeout)
            self.router.capacity = self.max_inflight_batches
        else:
            self.batcher.configure(1, 0.0)
            self.router.capacity = knobs.max_batch_size

    def submit(self, item: Item) -> None:
        self.batcher.add(item)

    def schedule(self, now: float) -> list[Dispatch]:
        dispatches = []
        while (worker_id := self.router.pick()) is not None:
            batch = self.batcher.pop_batch(now)
            if batch is None:
                break
            self.router.assign(worker_id, batch.batch_id, len(batch.items))
            dispatches.append(Dispatch(worker_id, batch))
        return dispatches

    def next_wakeup(self) -> float | None:
        """When a waiting batch falls due; None when nothing waits or no worker has room."""
        if not self.router.has_room():
            return None
        return self.batcher.next_due()

    def queue_depth(self) -> int:
        return len(self.batcher)
