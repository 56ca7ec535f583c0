"""The generation runner's KV caches: transformers' dynamic cache, whose layers append a step's
keys and values in place, into columns kept spare on the right, instead of concatenating.

transformers' `DynamicLayer` concatenates on every update, which copies the whole cache, every
row, once per layer per decode step; with a dozen rows a few hundred tokens long that copy is a
large share of a CPU decode step (docs/BENCHMARKS.md, "One model call per step"). Here a layer's
`keys` and `values` are still what transformers and the runner read, the used columns
`[rows, heads, columns, head_dim]`, but as views of a buffer `SPARE_COLUMNS` wider; a step writes
its column into the buffer. Whatever replaces `keys` or `values` (the runner trims, selects and
merges rows, each a copy already) is moved into a new buffer at its next update.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

SPARE_COLUMNS = 32
"""Columns a buffer holds beyond those in use: a copy every 32 decode steps instead of every step.
A worker's cache may so hold up to rows × 32 token slots more than its KV cap counts."""


class SpareColumnsLayer(DynamicLayer):
    """A `DynamicLayer` that appends into spare columns of a buffer."""

    def __init__(self):
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = used + key_states.shape[-2]
        if not _holds(self._key_buffer, self.keys, end):
            self._key_buffer, self._value_buffer = _buffer(self.keys, key_states, end), _buffer(self.values, value_states, end)
        self._key_buffer[:, :, used:end] = key_states
        self._value_buffer[:, :, used:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values


def _holds(buffer: torch.Tensor | None, used: torch.Tensor, end: int) -> bool:
    """`used` is still the front of `buffer` (nobody replaced it) and the buffer has room up to `end`."""
    return (buffer is not None and used.dim() == 4 and used.data_ptr() == buffer.data_ptr()
            and used.shape[:2] == buffer.shape[:2] and buffer.shape[-2] >= end)


def _buffer(used: torch.Tensor, new: torch.Tensor, end: int) -> torch.Tensor:
    """A buffer for `end` columns and the spare ones, holding the `used` columns already cached."""
    rows, heads, _, dim = new.shape
    buffer = new.new_empty((rows, heads, end + SPARE_COLUMNS, dim))
    if used.dim() == 4 and used.shape[-2]:
        buffer[:, :, :used.shape[-2]] = used
    return buffer


class KVCache(DynamicCache):
    """A `DynamicCache` of `SpareColumnsLayer`s (full attention in every layer, as the runner assumes)."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=SpareColumnsLayer)
