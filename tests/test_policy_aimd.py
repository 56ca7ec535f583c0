"""The aimd policy: additive increase, multiplicative decrease of max_batch_size against a p99 SLO."""

from __future__ import annotations

import pytest
from policy_helpers import BOUNDS, aimd, obs

from engine.config import Bounds, Knobs
from policies.aimd import AimdParams, AimdPolicy


def test_aimd_decreases_multiplicatively_over_slo_with_a_cooldown():
    policy = aimd(decrease_factor=0.75, cooldown_seconds=10)
    knobs = Knobs(max_batch_size=32)
    sizes = []
    for t in range(0, 31):
        knobs = policy.decide(obs(t, p99=0.8, batch_size=10), knobs, BOUNDS).knobs
        sizes.append(knobs.max_batch_size)
    assert sizes[0] == 24 and sizes[9] == 24
    assert sizes[10] == 18 and sizes[20] == 13 and sizes[30] == 9


@pytest.mark.parametrize("size, expected", [(3, 2), (2, 1), (1, 1)])
def test_aimd_decreases_by_at_least_one_and_stops_at_the_bound(size, expected):
    decision = aimd().decide(obs(0, p99=0.8), Knobs(max_batch_size=size), BOUNDS)
    assert decision.knobs.max_batch_size == expected


def test_aimd_increases_additively_when_batches_are_full_and_p99_is_fine():
    policy = aimd(additive_step=2, fill_threshold=0.8, cooldown_seconds=0)
    knobs = Knobs(max_batch_size=16)
    decision = policy.decide(obs(0, p99=0.2, batch_size=15), knobs, BOUNDS)
    assert decision.knobs.max_batch_size == 18
    assert "batches full" in decision.reason and "max_batch_size 16 -> 18" in decision.reason
    decision = policy.decide(obs(1, p99=0.2, batch_size=17.9), decision.knobs, BOUNDS)
    assert decision.knobs.max_batch_size == 20


def test_aimd_holds_when_batches_are_not_full():
    decision = aimd().decide(obs(0, p99=0.2, batch_size=8), Knobs(max_batch_size=16), BOUNDS)
    assert decision.knobs.max_batch_size == 16
    assert "not full" in decision.reason


def test_aimd_waits_for_enough_requests():
    policy = aimd(min_requests=20)
    decision = policy.decide(obs(0, p99=5.0, count=19), Knobs(max_batch_size=16), BOUNDS)
    assert decision.knobs.max_batch_size == 16
    assert "19 total latencies" in decision.reason
    assert policy.decide(obs(1, p99=5.0, count=20), Knobs(max_batch_size=16), BOUNDS).knobs.max_batch_size == 12


def test_aimd_can_halve_batch_timeout_over_slo():
    knobs = Knobs(max_batch_size=16, batch_timeout=0.01)
    assert aimd().decide(obs(0, p99=0.8), knobs, BOUNDS).knobs.batch_timeout == 0.01
    assert aimd(halve_timeout_over_slo=True).decide(obs(0, p99=0.8), knobs, BOUNDS).knobs.batch_timeout == 0.005


def test_aimd_with_a_model_budget_grows_full_batches_when_queueing_breaks_the_slo():
    policy = aimd(model_budget_fraction=0.5, cooldown_seconds=0, additive_step=2)
    queueing = policy.decide(obs(0, p99=2.0, model_mean=0.05, batch_size=1.0), Knobs(max_batch_size=1), BOUNDS)
    assert queueing.knobs.max_batch_size == 3
    assert "(queueing)" in queueing.reason and "batches full" in queueing.reason
    not_full = policy.decide(obs(1, p99=2.0, model_mean=0.05, batch_size=4.0), Knobs(max_batch_size=16), BOUNDS)
    assert not_full.knobs.max_batch_size == 16 and "batches not full" in not_full.reason
    slow_batch = policy.decide(obs(2, p99=2.0, model_mean=0.3, batch_size=16.0), Knobs(max_batch_size=16), BOUNDS)
    assert slow_batch.knobs.max_batch_size == 12  # the batch itself takes > 0.5 × SLO: shrink
    far_too_slow = policy.decide(obs(2.5, p99=3.0, model_mean=2.0, batch_size=32.0), Knobs(max_batch_size=32), BOUNDS)
    assert far_too_slow.knobs.max_batch_size == 4  # 32 × 0.25 s / 2 s: in proportion, not × 0.75
    no_model_stage = policy.decide(obs(3, p99=2.0, batch_size=16.0), Knobs(max_batch_size=16), BOUNDS)
    assert no_model_stage.knobs.max_batch_size == 12
    doubling = aimd(model_budget_fraction=0.5, cooldown_seconds=0, queueing_growth_factor=2)
    assert doubling.decide(obs(0, p99=2.0, model_mean=0.05, batch_size=8.0), Knobs(max_batch_size=8), BOUNDS).knobs.max_batch_size == 16
    assert doubling.decide(obs(1, p99=0.3, batch_size=16.0), Knobs(max_batch_size=16), BOUNDS).knobs.max_batch_size == 18  # within the SLO: additive
    clipper = aimd(cooldown_seconds=0).decide(obs(0, p99=2.0, model_mean=0.05, batch_size=1.0), Knobs(max_batch_size=4), BOUNDS)
    assert clipper.knobs.max_batch_size == 3


def test_aimd_never_shrinks_below_the_items_a_request_brings_each_worker():
    """Requests of 32 texts on two workers (the bench's indexing load: 2 req/s, 64 items/s): a
    batch over its model budget shrinks to 16, the half of a request each worker takes, and no
    further; one-text requests shrink as before."""
    policy = aimd(model_budget_fraction=0.5, cooldown_seconds=0)
    two = Knobs(process_count=2, max_batch_size=32)
    many = dict(p99=1.4, model_mean=0.6, batch_size=32.0, arrival=2.0, items_rate=64.0)
    assert policy.decide(obs(0, **many), two, BOUNDS).knobs.max_batch_size == 16  # 32 × 0.25 / 0.6 = 13 in proportion
    held = policy.decide(obs(1, **many), two.replace(max_batch_size=16), BOUNDS)
    assert held.knobs.max_batch_size == 16 and "brings each worker 16 items" in held.reason
    one_worker = policy.decide(obs(2, **many), two.replace(process_count=1), BOUNDS)
    assert one_worker.knobs.max_batch_size == 32  # a worker takes the whole request
    single = dict(many, items_rate=2.0)
    assert policy.decide(obs(3, **single), two, BOUNDS).knobs.max_batch_size == 13


def test_aimd_moves_in_whole_shares_of_a_request_of_many_items():
    """32-text requests on two workers (16 items each): growth from 16 goes to 32, not 18 (batches
    of 18 and 14 are no faster per item than 16, so the efficiency judge undid 18 and 32 was never
    tried); a cut from 48 goes to 32, not 36; one-text requests step by 2 as before."""
    policy = aimd(additive_step=2, cooldown_seconds=0, model_budget_fraction=0.5)
    two = Knobs(process_count=2, max_batch_size=16)
    many = dict(arrival=2.0, items_rate=64.0)
    assert policy.decide(obs(0, p99=0.2, batch_size=16.0, **many), two, BOUNDS).knobs.max_batch_size == 32
    assert policy.decide(obs(1, p99=0.2, batch_size=30.0, **many), two.replace(max_batch_size=32), BOUNDS).knobs.max_batch_size == 48
    over = policy.decide(obs(2, p99=1.4, model_mean=0.3, batch_size=48.0, **many), two.replace(max_batch_size=48), BOUNDS)
    assert over.knobs.max_batch_size == 32
    assert policy.decide(obs(3, p99=0.2, batch_size=16.0, arrival=2.0, items_rate=2.0), two, BOUNDS).knobs.max_batch_size == 18


def test_aimd_undoes_a_growth_that_did_not_pay_and_keeps_a_ceiling():
    policy = aimd(min_efficiency_gain=0.02, ceiling_seconds=100, cooldown_seconds=10, additive_step=4)
    knobs = Knobs(max_batch_size=8)
    # at 8: 8 items per 40 ms batch = 200 items per model-second; grows to 12
    knobs = policy.decide(obs(0, p99=0.2, batch_size=8, model_mean=0.040), knobs, BOUNDS).knobs
    assert knobs.max_batch_size == 12
    # at 12: 12 items per 50 ms = 240/s, +20 %: it paid, grow to 16
    knobs = policy.decide(obs(10, p99=0.2, batch_size=12, model_mean=0.050), knobs, BOUNDS).knobs
    assert knobs.max_batch_size == 16
    # at 16: 16 items per 70 ms = 229/s < 240: back to 12, which becomes the ceiling
    decision = policy.decide(obs(20, p99=0.2, batch_size=16, model_mean=0.070), knobs, BOUNDS)
    assert decision.knobs.max_batch_size == 12 and "did not pay" in decision.reason
    held = policy.decide(obs(30, p99=0.2, batch_size=12, model_mean=0.050), decision.knobs, BOUNDS)
    assert held.knobs.max_batch_size == 12 and "ceiling" in held.reason
    # the ceiling expires: it tries again
    assert policy.decide(obs(125, p99=0.2, batch_size=12, model_mean=0.050), held.knobs, BOUNDS).knobs.max_batch_size == 16
    # without the check (Clipper's rule) it keeps growing
    plain = aimd(cooldown_seconds=0, additive_step=4)
    assert plain.decide(obs(0, p99=0.2, batch_size=16, model_mean=0.070), Knobs(max_batch_size=16), BOUNDS).knobs.max_batch_size == 20


def test_aimd_does_not_undo_a_growth_whose_batches_never_outgrew_the_old_size():
    """Recorded live (2026-12-07, one-sentence ladder): queueing grew 16 -> 32, the next window's
    batches averaged 12.6, and the growth was undone as "224 items per model-second at 32 vs 225 at
    16: did not pay", with 16 the ceiling for 120 s. Batches no larger than before tried nothing."""
    policy = aimd(min_efficiency_gain=0.02, ceiling_seconds=120, cooldown_seconds=10, additive_step=2, model_budget_fraction=0.5, queueing_growth_factor=2)
    queueing = dict(p99=1.097, batch_size=13.76, model_mean=0.061, batch_seconds=0.0612)
    knobs = policy.decide(obs(0, **queueing), Knobs(max_batch_size=16), BOUNDS).knobs
    assert knobs.max_batch_size == 32
    untried = policy.decide(obs(14, p99=0.9, batch_size=12.56, model_mean=0.056, batch_seconds=0.0561), knobs, BOUNDS)
    assert untried.knobs.max_batch_size == 32 and "did not pay" not in untried.reason
    # batches that did grow, and did not get cheaper per item, are still sent back
    policy = aimd(min_efficiency_gain=0.02, ceiling_seconds=120, cooldown_seconds=10, additive_step=2, model_budget_fraction=0.5, queueing_growth_factor=2)
    knobs = policy.decide(obs(0, **queueing), Knobs(max_batch_size=16), BOUNDS).knobs
    tried = policy.decide(obs(14, p99=0.9, batch_size=27.8, model_mean=0.124, batch_seconds=0.124), knobs, BOUNDS)
    assert tried.knobs.max_batch_size == 16 and "did not pay" in tried.reason


def test_aimd_judges_a_growth_that_broke_the_slo_too():
    """Long inputs gain nothing from batching: 1 -> 3 makes each batch 3 x slower and breaks the
    SLO. Cutting back without judging the growth would retry it at the next good window."""
    policy = aimd(min_efficiency_gain=0.02, ceiling_seconds=100, cooldown_seconds=10, additive_step=2, model_budget_fraction=0.5)
    knobs = policy.decide(obs(0, p99=0.3, batch_size=1, model_mean=0.100), Knobs(max_batch_size=1), BOUNDS).knobs
    assert knobs.max_batch_size == 3
    # at 3: 2 items per 200 ms batch = 10 items per model-second, as at 1: it did not pay
    decision = policy.decide(obs(10, p99=0.8, batch_size=2, model_mean=0.300, batch_seconds=0.200), knobs, BOUNDS)
    assert decision.knobs.max_batch_size == 1 and "did not pay" in decision.reason
    held = policy.decide(obs(20, p99=0.3, batch_size=1, model_mean=0.100), decision.knobs, BOUNDS)
    assert held.knobs.max_batch_size == 1 and "ceiling" in held.reason


def test_aimd_does_not_judge_a_growth_across_a_layout_change():
    policy = aimd(min_efficiency_gain=0.02, cooldown_seconds=0, additive_step=2)
    one_by_two = Knobs(process_count=1, threads_per_process=2, max_batch_size=1)
    grown = policy.decide(obs(0, p99=0.2, batch_size=1, model_mean=0.010), one_by_two, BOUNDS).knobs
    assert grown.max_batch_size == 3
    # meanwhile another policy went to 2 x 1: one thread per batch is slower per item, not the size
    two_by_one = grown.replace(process_count=2, threads_per_process=1)
    decision = policy.decide(obs(10, p99=0.2, batch_size=3, model_mean=0.045), two_by_one, BOUNDS)
    assert decision.knobs.max_batch_size == 5 and "did not pay" not in decision.reason


def test_aimd_does_not_judge_a_growth_long_after_it():
    policy = aimd(min_efficiency_gain=0.02, cooldown_seconds=10, additive_step=3)
    knobs = policy.decide(obs(0, p99=0.2, batch_size=3, model_mean=0.015), Knobs(max_batch_size=3), BOUNDS).knobs
    assert knobs.max_batch_size == 6
    # the burst ended before the next decision could judge it; 40 s later another burst, other batches
    decision = policy.decide(obs(40, p99=0.2, batch_size=6, model_mean=0.060), knobs, BOUNDS)
    assert decision.knobs.max_batch_size == 9 and "did not pay" not in decision.reason


def test_aimd_does_not_shrink_batches_that_saturated_workers_need():
    knobs = Knobs(max_batch_size=64)
    slow_batches = dict(p99=0.9, model_mean=0.35, batch_size=30.0)  # model p99 0.35 s > 0.5 × SLO
    saturated = aimd(model_budget_fraction=0.5, shrink_below_busy=0.9).decide(obs(0, busy=0.97, **slow_batches), knobs, BOUNDS)
    assert saturated.knobs.max_batch_size == 64 and "busy 0.97" in saturated.reason
    headroom = aimd(model_budget_fraction=0.5, shrink_below_busy=0.9).decide(obs(0, busy=0.6, **slow_batches), knobs, BOUNDS)
    assert headroom.knobs.max_batch_size < 64  # spare capacity: a smaller batch is affordable
    assert aimd(model_budget_fraction=0.5).decide(obs(0, busy=0.97, **slow_batches), knobs, BOUNDS).knobs.max_batch_size < 64


def test_aimd_uses_the_configured_stage():
    policy = aimd(stage="ttft")
    decision = policy.decide(obs(0, p99=5.0), Knobs(max_batch_size=16), BOUNDS)  # only "total" present
    assert decision.knobs.max_batch_size == 16


def test_aimd_grows_only_below_the_increase_threshold():
    policy = AimdPolicy(AimdParams(slo_p99_seconds=1.0, increase_below=0.7, cooldown_seconds=0))
    knobs = Knobs(max_batch_size=8)
    held = policy.decide(obs(0.0, p99=0.8, batch_size=8.0, count=100), knobs, Bounds())
    assert held.knobs.max_batch_size == 8 and "0.7" in held.reason
    grown = policy.decide(obs(1.0, p99=0.5, batch_size=8.0, count=100), knobs, Bounds())
    assert grown.knobs.max_batch_size > 8


def test_aimd_grows_full_batches_of_saturated_workers_before_the_slo_breaks():
    knobs = Knobs(max_batch_size=16)
    fine = dict(p99=0.42, batch_size=14.1, model_mean=0.07)  # B1's window at 40.7 s, 2026-12-07
    policy = dict(cooldown_seconds=0, additive_step=2, queueing_growth_factor=2, saturated_busy=0.9)
    saturated = aimd(**policy).decide(obs(0, busy=0.95, **fine), knobs, BOUNDS)
    assert saturated.knobs.max_batch_size == 32 and "busy 0.95 >= 0.9" in saturated.reason
    assert aimd(**policy).decide(obs(0, busy=0.8, **fine), knobs, BOUNDS).knobs.max_batch_size == 18  # room left: a step
    unset = {k: v for k, v in policy.items() if k != "saturated_busy"}
    assert aimd(**unset).decide(obs(0, busy=0.95, **fine), knobs, BOUNDS).knobs.max_batch_size == 18  # Clipper's rule
