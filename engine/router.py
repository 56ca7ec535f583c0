"""Router: a pure state machine that tracks workers and picks the least-loaded ready one.

A worker is STARTING until it has warmed up, READY while it takes traffic, and DRAINING once
it has been chosen to retire: it finishes what it holds but receives nothing new. Load is
counted in units (an embedding batch, or a generation sequence) against a per-worker capacity.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass(slots=True)
class WorkerSlot:
    worker_id: int
    state: WorkerState = WorkerState.STARTING
    assigned: dict[int, int] = field(default_factory=dict)
    """Work key (batch or sequence id) -> items it carries."""
    started_seq: int = 0
    warmed: bool = False
    """It has said it is ready once (a worker drained while starting stops only after that)."""
    stopping: bool = False
    """`take_stoppable` has named it: its caller stops it."""

    @property
    def load(self) -> int:
        return len(self.assigned)

    @property
    def items(self) -> int:
        return sum(self.assigned.values())


class Router:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._workers: dict[int, WorkerSlot] = {}
        self._order = 0

    def add(self, worker_id: int) -> None:
        self._order += 1
        self._workers[worker_id] = WorkerSlot(worker_id, started_seq=self._order)

    def mark_ready(self, worker_id: int) -> None:
        slot = self._workers[worker_id]
        slot.warmed = True
        if slot.state is WorkerState.STARTING:
            slot.state = WorkerState.READY

    def drain(self, worker_id: int) -> None:
        self._workers[worker_id].state = WorkerState.DRAINING

    def remove(self, worker_id: int) -> dict[int, int]:
        """Forget a worker; returns the work it still held (to re-run or fail)."""
        return self._workers.pop(worker_id).assigned

    def assign(self, worker_id: int, key: int, items: int) -> None:
        self._workers[worker_id].assigned[key] = items

    def complete(self, worker_id: int, key: int) -> None:
        slot = self._workers.get(worker_id)
        if slot is not None:
            slot.assigned.pop(key, None)

    def pick(self) -> int | None:
        """The ready worker with the least load that still has room; None if all are full."""
        best = None
        for slot in self._workers.values():
            if slot.state is not WorkerState.READY or slot.load >= self.capacity:
                continue
            rank = (slot.load, slot.items, slot.worker_id)
            if best is None or rank < best[0]:
                best = (rank, slot.worker_id)
        return None if best is None else best[1]

    def has_room(self) -> bool:
        return self.pick() is not None

    def state(self, worker_id: int) -> WorkerState:
        return self._workers[worker_id].state

    def slot(self, worker_id: int) -> WorkerSlot:
        return self._workers[worker_id]

    def workers(self) -> list[WorkerSlot]:
        return list(self._workers.values())

    def active(self) -> list[WorkerSlot]:
        """Workers that count toward process_count: starting or ready, not draining."""
        return [s for s in self._workers.values() if s.state is not WorkerState.DRAINING]

    def choose_to_retire(self, count: int) -> list[int]:
        """Which active workers to drain: those still starting first, then the newest."""
        ranked = sorted(
            self.active(),
            key=lambda s: (s.state is not WorkerState.STARTING, s.load, -s.started_seq),
        )
        return [s.worker_id for s in ranked[:count]]

    def idle_draining(self) -> list[int]:
        return [s.worker_id for s in self._workers.values() if s.state is WorkerState.DRAINING and not s.assigned]

    def take_stoppable(self) -> list[int]:
        """Draining workers that hold nothing and have warmed up, each named once."""
        out = [w for w in self.idle_draining() if self._workers[w].warmed and not self._workers[w].stopping]
        for worker_id in out:
            self._workers[worker_id].stopping = True
        return out
