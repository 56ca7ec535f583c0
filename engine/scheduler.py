"""Scheduler: batcher + router, the pure decision core that the live engine and the simulator share.

Events go in (`submit`, worker ready, work complete), `reconcile(process_count)` says which
workers to start, drain and stop, and `schedule(now)` returns the dispatches to carry out;
`next_wakeup()` says when to call it again if nothing else happens.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from engine.batcher import Batch, Batcher, Item
from engine.config import INFLIGHT_BATCHES, Knobs, Task
from engine.router import Router, WorkerState


@dataclass(frozen=True, slots=True)
class Dispatch:
    worker_id: int
    batch: Batch


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """What one `reconcile` asks of whoever runs the workers (the live supervisor or the simulator)."""

    start: tuple[int, ...] = ()
    """Ids of new workers to start; the router has them as STARTING already."""
    drained: tuple[int, ...] = ()
    """Workers that began draining now: they finish what they hold and get nothing new."""
    stop: tuple[int, ...] = ()
    """Draining workers that are idle and warm: stop them (each is named once)."""


class Scheduler:
    def __init__(self, task: Task, knobs: Knobs, max_inflight_batches: int = INFLIGHT_BATCHES, queue_timeout: float | None = None):
        self.task = task
        self.max_inflight_batches = max_inflight_batches
        self.queue_timeout = queue_timeout
        """Seconds an item may wait for a worker (limits.queue_timeout_seconds); None: no limit."""
        self.batcher = Batcher(1, 0.0)
        self.router = Router(1)
        self._next_worker_id = 0
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

    def reconcile(self, process_count: int, may_start: bool = True) -> WorkerPlan:
        """Bring the active workers (starting or ready) to process_count: start, or drain the
        extra; and name the drained workers that can stop. `may_start` False holds starts back
        (the live engine's restart backoff)."""
        router = self.router
        missing = process_count - len(router.active())
        start: tuple[int, ...] = ()
        drained: tuple[int, ...] = ()
        if missing > 0 and may_start:
            start = tuple(range(self._next_worker_id, self._next_worker_id + missing))
            self._next_worker_id += missing
            for worker_id in start:
                router.add(worker_id)
        elif missing < 0:
            drained = tuple(router.choose_to_retire(-missing))
            for worker_id in drained:
                router.drain(worker_id)
        return WorkerPlan(start, drained, tuple(router.take_stoppable()))

    def submit(self, item: Item) -> None:
        self.batcher.add(item)

    def shed(self, now: float) -> list[Item]:
        """The items that have waited `queue_timeout` without a worker, taken out of the queue for
        the caller to refuse (a 429). Called before `schedule`: an item at its limit is shed even if
        a worker has just freed up, so the limit means the same whatever the timing of a turn."""
        if self.queue_timeout is None:
            return []
        return self.batcher.expire(now - self.queue_timeout)

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
        """When a waiting batch falls due (if a worker has room) or the oldest item reaches its
        queue limit; None when neither can happen."""
        due = self.batcher.next_due() if self.router.has_room() else None
        oldest = self.batcher.oldest_arrival()
        if self.queue_timeout is not None and oldest is not None:
            expiry = oldest + self.queue_timeout
            due = expiry if due is None else min(due, expiry)
        return due

    def deferrable_items(self) -> int:
        """How many more embedding items may arrive before the next `schedule` without changing
        when any of them goes: 0 when an arrival needs a turn of its own. The live core lets the
        front skip its wake-up for those; a turn comes anyway, from the timer `next_wakeup` set for
        what waits (so it is due no later than an arrival's own batch would be) or from a busy
        worker's result (while none has room, nothing can go sooner)."""
        if self.task != "embed" or not self.batcher:
            return 0  # nothing waits, so no turn is due: the first item must ask for one
        if self.router.has_room():
            return max(0, self.batcher.max_batch_size - len(self.batcher) - 1)  # the next fills a batch
        busy = any(s.state is WorkerState.READY for s in self.router.workers())
        return sys.maxsize if busy else 0  # no worker ready: a crash loop must still see the item

    def queue_depth(self) -> int:
        return len(self.batcher)
