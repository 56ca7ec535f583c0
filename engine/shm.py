"""Shared-memory slots between the front process and one worker.

Each worker creates an anonymous memfd (it never appears in /dev/shm, so nothing can leak
there, whatever dies how) and passes its fd to the front over their socket. The memory is
split into `slots`; a slot holds one batch's token ids going in and its vectors coming out.
Both sides see the same pages as numpy arrays, so batches cross without pickled copies.
"""

from __future__ import annotations

import mmap
import os

import numpy as np


class SlotBuffer:
    def __init__(self, fd: int, slots: int, slot_items: int, max_length: int, hidden_size: int):
        self.slots = slots
        self.slot_items = slot_items
        self.max_length = max_length
        self.hidden_size = hidden_size
        size = self.nbytes(slots, slot_items, max_length, hidden_size)
        self._fd = fd
        self._map = mmap.mmap(fd, size)
        ids_count = slots * slot_items * max_length
        self._ids = np.frombuffer(self._map, dtype=np.int32, count=ids_count).reshape(
            slots, slot_items * max_length
        )
        self._out = np.frombuffer(
            self._map, dtype=np.float32, count=slots * slot_items * hidden_size, offset=ids_count * 4
        ).reshape(slots, slot_items, hidden_size)

    @staticmethod
    def nbytes(slots: int, slot_items: int, max_length: int, hidden_size: int) -> int:
        return slots * slot_items * (max_length * 4 + hidden_size * 4)

    @classmethod
    def create(cls, slots: int, slot_items: int, max_length: int, hidden_size: int) -> "SlotBuffer":
        fd = os.memfd_create("selftune-slots", os.MFD_CLOEXEC)
        os.ftruncate(fd, cls.nbytes(slots, slot_items, max_length, hidden_size))
        return cls(fd, slots, slot_items, max_length, hidden_size)

    @property
    def fd(self) -> int:
        return self._fd

    def ids(self, slot: int, rows: int, length: int) -> np.ndarray:
        """The (rows, length) int32 view of a slot's token ids."""
        return self._ids[slot, : rows * length].reshape(rows, length)

    def out(self, slot: int, rows: int) -> np.ndarray:
        """The (rows, hidden) float32 view of a slot's output vectors."""
        return self._out[slot, :rows]

    def close(self) -> None:
        self._ids = self._out = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view still lives somewhere; the mapping goes when it does
        os.close(self._fd)
