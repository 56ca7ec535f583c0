"""engine/kv_cache.py: a decode step writes its column into spare room of the layer's buffer
instead of copying the whole cache, and the keys and values read back are those a concatenating
cache would hold, also after the runner replaced them (trimmed or merged rows)."""

from __future__ import annotations

import torch

from engine.kv_cache import SPARE_COLUMNS, KVCache


def _kv(rows, columns, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, columns, 4, generator=g), torch.randn(rows, 2, columns, 4, generator=g)


def test_decode_columns_are_written_in_place_and_read_back_as_concatenated():
    cache = KVCache()
    keys, values = _kv(3, 10, 0)
    cache.update(keys, values, 0)
    first = cache.layers[0].keys.data_ptr()
    for step in range(SPARE_COLUMNS):
        k, v = _kv(3, 1, step + 1)
        got_k, got_v = cache.update(k, v, 0)
        keys, values = torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
        assert cache.layers[0].keys.data_ptr() == first  # no copy while the spare columns last
    k, v = _kv(3, 1, 99)
    got_k, _ = cache.update(k, v, 0)
    assert got_k.data_ptr() != first and torch.equal(got_k, torch.cat([keys, k], dim=-2))  # full: one copy, room again
    assert cache.get_seq_length() == 10 + SPARE_COLUMNS + 1


def test_keys_the_runner_replaced_are_moved_to_a_new_buffer_before_the_next_column():
    cache = KVCache()
    keys, values = _kv(3, 6, 0)
    cache.update(keys, values, 0)
    layer = cache.layers[0]
    layer.keys, layer.values = layer.keys[[0, 2], :, 2:], layer.values[[0, 2], :, 2:]  # rows dropped, columns trimmed
    k, v = _kv(2, 1, 1)
    got_k, got_v = cache.update(k, v, 0)
    assert torch.equal(got_k, torch.cat([keys[[0, 2], :, 2:], k], dim=-2))
    assert torch.equal(got_v, torch.cat([values[[0, 2], :, 2:], v], dim=-2))
    # a view of the old buffer's first rows is not the buffer's front either: moved, not overwritten
    layer.keys, layer.values = layer.keys[:1], layer.values[:1]
    before = layer.keys.clone()
    got_k, _ = cache.update(k[:1], v[:1], 0)
    assert torch.equal(got_k, torch.cat([before, k[:1]], dim=-2))
