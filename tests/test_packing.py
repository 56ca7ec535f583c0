"""Sequence packing: the plan (pure) and the packed forward pass (real MiniLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import minilm_dir

from engine import packing
from engine.embedding import EmbeddingRunner


def test_plan_packs_every_item_once_within_the_row_limit():
    lengths = [30, 12, 45, 8, 20, 33, 10, 50, 16, 9]
    plan = packing.plan(lengths, 64)
    assert plan is not None
    placed = sorted(i for row in plan.rows for i in row)
    assert placed == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in row) for row in plan.rows]
    assert max(sums) <= 64 and plan.row_length == max(sums)
    assert len(plan.rows) * plan.row_length < len(lengths) * max(lengths)


def test_plan_keeps_batches_that_padding_does_not_waste():
    assert packing.plan([20, 20, 20, 20], 128) is None  # equal lengths: nothing to save
    assert packing.plan([20, 19, 20, 18], 128) is None  # saving under 10 %
    assert packing.plan([30, 5], 0) is None  # packing switched off
    assert packing.plan([30], 128) is None
    assert packing.shape([20, 20, 20], 128) == (3, 20)


def test_an_input_longer_than_a_row_gets_a_row_of_its_own():
    plan = packing.plan([300, 10, 12, 9], 128)
    assert plan is not None
    assert plan.row_length == 300
    (long_row,) = [row for row in plan.rows if 0 in row]
    assert long_row == (0,)  # nothing fits beside it: 300 is the row's whole capacity


@pytest.fixture(scope="module")
def model():
    from engine.loading import load_model

    return load_model(minilm_dir(), "embed", torch.float32)


def _embed(runner, batch):
    ids = np.zeros((len(batch), max(map(len, batch))), dtype=np.int32)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = seq
    out = np.empty((len(batch), 384), dtype=np.float32)
    runner.run(ids, tuple(map(len, batch)), out)
    return out


def test_packed_forward_matches_each_input_run_alone(model):
    rng = np.random.default_rng(1)
    batch = [list(rng.integers(1000, 20000, n)) for n in (3, 41, 17, 9, 60, 25, 12, 33)]
    assert packing.plan(list(map(len, batch)), 64) is not None
    packed = _embed(EmbeddingRunner(model, "cpu", 64), batch)
    alone = np.concatenate([_embed(EmbeddingRunner(model, "cpu", 0), [seq]) for seq in batch])
    assert np.abs(packed - alone).max() < 1e-5


class _IgnoresPositions(torch.nn.Module):
    """A model whose forward drops position ids: packing would give wrong embeddings."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, position_ids=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_packing_switches_itself_off_for_a_model_it_would_get_wrong(model):
    assert EmbeddingRunner(model, "cpu", 128, 30522).check_packing()
    runner = EmbeddingRunner(_IgnoresPositions(model), "cpu", 128, 30522)
    rng = np.random.default_rng(2)
    batch = [list(rng.integers(1000, 20000, n)) for n in (3, 41, 17, 9)]
    _embed(runner, batch)  # the first mixed batch runs the check, which switches packing off
    assert runner.pack_row_tokens == 0
    assert not runner.check_packing()
