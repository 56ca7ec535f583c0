"""The generate policy around a burst: the chunk grows for TTFT only while waiting prompts need more
prefill than a chunk holds, and no layout bet is made on a burst's draining backlog."""

from __future__ import annotations

from policy_helpers import GEN_START as START
from policy_helpers import gen_decide as decide
from policy_helpers import gen_obs

from policies.gen_load import chunk_binds


def test_the_chunk_grows_for_ttft_only_when_the_waiting_prompts_need_more_than_one_chunk():
    at = START.replace(max_batch_tokens=512)
    assert chunk_binds(gen_obs(0, waiting=2, prompt=400), 512) and not chunk_binds(gen_obs(0, waiting=1, prompt=400), 512)
    assert not chunk_binds(gen_obs(0, waiting=0, prompt=400), 0) and chunk_binds(gen_obs(0, waiting=1, prompt=400), 256)
    binds = decide(gen_obs(0, ttft=3.0, itl=0.1, held=4, waiting=2, prompt=400), at)  # 800 prompt tokens wait, 512 a step
    assert binds.knobs.max_batch_tokens == 1024 and "prompts wait in the workers" in binds.reason
    # one prompt arrived since the step began: the next step prefills it whatever the chunk, so the
    # policy's other moves for TTFT apply (here, full batches and a queue: a larger batch)
    newest = decide(gen_obs(0, ttft=3.0, itl=0.1, held=16, waiting=1, queue_depth=3, prompt=400), at)
    assert newest.knobs == at.replace(max_batch_size=20) and "behind full batches" in newest.reason


def test_no_layout_bet_while_a_bursts_backlog_drains():
    """ITL over, nothing prefilling, batches not full: a bet on more threads per step; not while
    requests finish faster than they arrive (a burst's backlog draining): that ITL p99 is the
    burst's, and ITL p50 after the move would be the quiet's, so the bet would look paid regardless."""
    steady = decide(gen_obs(0, itl=0.4, ttft=0.5, held=4, prompt=50))
    assert (steady.knobs.process_count, steady.knobs.threads_per_process) == (1, 2) and "more threads per step" in steady.reason
    draining = decide(gen_obs(0, itl=0.4, ttft=0.5, held=4, prompt=50, arrivals=0.4, completions=2.5))
    assert draining.knobs == START
    assert "finish faster than they arrive (0.40 against 2.50 a second): the load that made it is leaving, holding" in draining.reason
