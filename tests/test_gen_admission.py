"""engine.gen_admission, pure: who joins a generation worker's batch under the step's token
budget and the KV cap, chunked prefill, and how many of the youngest rows a step preempts."""

from __future__ import annotations

from engine.gen_admission import KV_RESERVE, admit, chunk_end, footprint_after_decode, preemptions, prefills_in_chunks


def test_the_step_token_budget_bounds_what_joins_but_the_head_always_goes():
    assert admit([100, 100, 100], 0, 0, 8, None, 256) == 2  # a third would make 300 > 256 prompt tokens
    assert admit([100, 100, 100], 0, 0, 8, None, None) == 3  # no budget: whole prompts
    assert admit([500, 10], 0, 0, 8, None, 256) == 1 and prefills_in_chunks([500], 256)  # the head goes on in chunks
    assert not prefills_in_chunks([500, 10], 256) and not prefills_in_chunks([500], None)


def test_running_sequences_and_the_kv_reserve_hold_admissions_back_in_order():
    assert admit([1] * 10, 3, 5, 5, None, None) == 2  # two free rows of five
    fits = 3 * (60 + KV_RESERVE)
    assert admit([50, 1], 2, 60, 8, fits - 1, None) == 0  # the head waits, nothing overtakes it
    assert admit([50, 1], 2, 60, 8, fits, None) == 1
    assert admit([5000], 0, 0, 8, 100, None) == 1  # an empty batch takes the head (requests are checked against the ceiling)


def test_preemption_drops_the_youngest_until_the_next_decode_fits():
    assert footprint_after_decode([10, 20, 30], 0, 0, None) == 3 * 31
    assert preemptions([10, 20, 30], 0, 0, None, 3 * 31) == 0
    assert preemptions([10, 20, 30], 0, 0, None, 3 * 31 - 1) == 1  # [10, 20] then need 2 × 21
    assert preemptions([10, 20, 30], 1, 40, None, 80) == 2  # a joining row 40 wide: 2 × 41 > 80, 1 row + it fits
    assert preemptions([100], 0, 0, None, 10) == 0  # a row alone with nothing joining stays
    assert preemptions([100], 1, 5, None, 10) == 1 and preemptions([100], 0, 0, 50, 10) == 1
    assert preemptions([10, 20], 0, 0, None, None) == 0


def test_a_chunk_ends_at_the_budget_or_the_prompt():
    assert chunk_end(0, 100, 32) == 32 and chunk_end(96, 100, 32) == 100 and chunk_end(32, 100, None) == 100


def test_the_step_budget_binds_only_while_rows_decode_beside_the_prefill():
    from engine.gen_admission import IDLE_PREFILL_TOKENS, step_budget

    assert step_budget(32, running=3) == 32
    assert step_budget(32, running=0) == IDLE_PREFILL_TOKENS  # nobody's next token waits on this step
    assert step_budget(4096, running=0) == 4096 and step_budget(None, running=0) is None and step_budget(0, running=2) == 0
