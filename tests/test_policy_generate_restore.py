"""The generate policy's restore of a chunk ITL cut during a burst: back to where the cut came
from, but no larger than the chunk the burst began with (TTFT may have doubled it meanwhile)."""

from __future__ import annotations

from policy_helpers import GEN_START as START
from policy_helpers import GEN_TWO_CORES as TWO_CORES
from policy_helpers import gen_obs

from policies.generate import GenerateParams, GeneratePolicy


def run(cut_itl: float) -> list[tuple[int, str]]:
    """A calm window at 128, a burst (TTFT over, prompts waiting in the workers: the chunk doubles),
    ITL over as it ends (a cut in proportion to `cut_itl`), then two calm windows."""
    policy, knobs, log = GeneratePolicy(GenerateParams(retry_seconds=300)), START.replace(max_batch_tokens=128), []
    for obs in (gen_obs(0, ttft=0.4, itl=0.15),                                   # calm: the burst begins at 128
                gen_obs(15, ttft=3.0, itl=0.1, waiting=2, prompt=100),            # TTFT over: 128 -> 256
                gen_obs(30, ttft=1.0, itl=cut_itl, itl_mean=0.11, prompt=300),    # ITL over with prompts prefilling: a cut
                gen_obs(45, ttft=0.4, itl=0.15),                                  # calm again
                gen_obs(60, ttft=0.4, itl=0.15)):
        decision = policy.decide(obs, knobs, TWO_CORES)
        knobs = decision.knobs
        log.append((knobs.max_batch_tokens, decision.reason))
    return log


def test_a_cut_below_the_bursts_start_goes_back_to_the_start_not_to_the_doubled_chunk():
    log = run(cut_itl=0.5)  # 256 × 0.8 × 250 / 500 = 102
    assert [chunk for chunk, _ in log] == [128, 256, 102, 128, 128]
    assert "prompts wait in the workers" in log[1][1] and "smaller prefill chunks" in log[2][1]
    assert "nothing queued: the chunk ITL cut goes back to 128" in log[3][1]


def test_a_cut_that_stays_above_the_bursts_start_is_left_where_it_is():
    log = run(cut_itl=0.3)  # 256 × 0.8 × 250 / 300 = 170
    assert [chunk for chunk, _ in log] == [128, 256, 170, 170, 170]
    assert all("goes back" not in reason for _, reason in log)
