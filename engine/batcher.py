"""Dynamic batcher: a pure state machine that groups queued items into batches.

It is handed `now` and never reads a clock, so the live engine and the simulator drive the
same object. A batch closes when `max_batch_size` items wait or when the oldest item has
waited `batch_timeout`. Every batch holds the oldest waiting item (so nothing starves) plus the
items whose lengths are closest to it (so padding stays small).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine import packing


@dataclass(slots=True)
class Item:
    """One sequence to run: an embedding input or a generation prompt."""

    request_id: int
    index: int
    """Position of this item within its request."""
    length: int
    """Input tokens; batches group similar lengths."""
    arrival: float
    payload: Any = None
    """Opaque to the batcher (token ids, sampling parameters...)."""
    seq: int = field(default=-1, compare=False)
    """Arrival order, assigned by the batcher; ties in length go to the older item."""


@dataclass(slots=True)
class Batch:
    batch_id: int
    items: list[Item]
    formed_at: float

    @property
    def padded_length(self) -> int:
        return max(item.length for item in self.items)

    def shape(self, pack_row_tokens: int) -> tuple[int, int]:
        """(rows, tokens per row) the forward pass runs at, packed or padded (engine.packing)."""
        return packing.shape([item.length for item in self.items], pack_row_tokens)

    @property
    def fill(self) -> float:
        """Real tokens over padded tokens: 1.0 means no padding at all."""
        real = sum(item.length for item in self.items)
        return real / (self.padded_length * len(self.items))


class Batcher:
    def __init__(self, max_batch_size: int, batch_timeout: float):
        self.max_batch_size = max_batch_size
        self.batch_timeout = batch_timeout
        self._pending: OrderedDict[int, Item] = OrderedDict()  # seq -> item, oldest first
        self._seq = itertools.count()
        self._batch_ids = itertools.count()

    def configure(self, max_batch_size: int, batch_timeout: float) -> None:
        self.max_batch_size = max_batch_size
        self.batch_timeout = batch_timeout

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, item: Item) -> None:
        item.seq = next(self._seq)
        self._pending[item.seq] = item

    def requeue(self, items: Iterable[Item]) -> None:
        """Put items back (e.g. from a dead worker) ahead of everything that arrived later."""
        items = list(items)
        for item in items:
            if item.seq < 0:
                item.seq = next(self._seq)
        merged = items + list(self._pending.values())
        merged.sort(key=lambda item: (item.arrival, item.seq))
        self._pending = OrderedDict((item.seq, item) for item in merged)

    def clear(self) -> list[Item]:
        items = list(self._pending.values())
        self._pending.clear()
        return items

    def cancel(self, request_id: int) -> int:
        """Drop every waiting item of a request; returns how many were dropped."""
        doomed = [seq for seq, item in self._pending.items() if item.request_id == request_id]
        for seq in doomed:
            del self._pending[seq]
        return len(doomed)

    def expire(self, before: float) -> list[Item]:
        """Drop and return the waiting items that arrived at or before `before`, oldest first. Checked at
        the head: items come in nearly in arrival order, and one that tokenized faster than an
        older one goes no later than that one does."""
        oldest = self.oldest_arrival()
        if oldest is None or oldest > before:
            return []
        expired = [item for item in self._pending.values() if item.arrival <= before]
        for item in expired:
            del self._pending[item.seq]
        return expired

    def oldest_arrival(self) -> float | None:
        if not self._pending:
            return None
        return next(iter(self._pending.values())).arrival

    def next_due(self) -> float | None:
        """When the next batch closes if nothing else arrives; None when nothing waits."""
        oldest = self.oldest_arrival()
        if oldest is None:
            return None
        if len(self._pending) >= self.max_batch_size:
            return oldest
        return oldest + self.batch_timeout

    def pop_batch(self, now: float) -> Batch | None:
        """The batch that is due at `now`, removed from the queue; None if none is due."""
        due = self.next_due()
        if due is None or now < due:
            return None
        items = self._select()
        for item in items:
            del self._pending[item.seq]
        items.sort(key=lambda item: item.seq)
        return Batch(next(self._batch_ids), items, now)

    def _select(self) -> list[Item]:
        pending = self._pending.values()
        if len(self._pending) <= self.max_batch_size:
            return list(pending)
        anchor = next(iter(pending))
        return heapq.nsmallest(
            self.max_batch_size, pending, key=lambda item: (abs(item.length - anchor.length), item.seq)
        )
