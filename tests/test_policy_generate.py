"""The generation policy: TTFT and ITL p99 objectives -> layout, running sequences, prefill chunk, KV cap."""

from __future__ import annotations

import dataclasses
import json
import os

from policy_helpers import GEN_START as START
from policy_helpers import GEN_TWO_CORES as TWO_CORES
from policy_helpers import gen_decide as decide
from policy_helpers import gen_obs

from engine.config import Knobs
from monitors.observation import Latency, Load, Observation, WorkerObservation
from policies.generate import GenerateParams, GeneratePolicy

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "observations", "smollm2_generate_2core.json")

def test_holds_until_the_window_has_enough_inter_token_latencies():
    decision = decide(gen_obs(0, itl=5.0, tokens=10))
    assert decision.knobs == START and "10 of 20 inter-token latencies" in decision.reason


def test_both_objectives_met_holds():
    decision = decide(gen_obs(0, ttft=1.0, itl=0.1))
    assert decision.knobs == START and "holding" in decision.reason


def test_preemptions_double_a_binding_kv_cap_and_shrink_the_batch_at_the_ceiling():
    binding = decide(gen_obs(0, preemptions=3, kv_total=4096), START.replace(kv_tokens=4096))
    assert binding.knobs.kv_tokens == 8192 and "KV cap binds" in binding.reason
    # 4 rows hold 2048 of 4096 slots: 512 wide, 7 such rows fit (10 % spare); 16 may run
    ceiling = decide(gen_obs(0, preemptions=3, kv_total=4096), START.replace(kv_tokens=0))
    assert (ceiling.knobs.kv_tokens, ceiling.knobs.max_batch_size) == (0, 12) and "7 rows of 512 slots fit the KV cache" in ceiling.reason
    assert decide(gen_obs(0, preemptions=3, kv_total=4096), START.replace(max_batch_size=9)).knobs.max_batch_size == 7  # not below what fits
    below = decide(gen_obs(0, preemptions=3, kv_total=4096), START.replace(kv_tokens=9000))  # the ceiling binds, not the knob
    assert below.knobs.max_batch_size == 12
    narrow = decide(gen_obs(0, preemptions=3, kv_total=4096, held=16), START)  # 16 rows of 128: 28 fit, the limit is not it
    assert narrow.knobs == START


def test_itl_over_while_prompts_prefill_cuts_the_chunk_in_proportion_down_to_its_floor():
    """ITL p99 is a step that prefilled a whole chunk: the chunk scales to what would put that step at
    80 % of the objective (256 × 0.8 × 250 ms / p99), a quarter of it at most, min_batch_tokens at least."""
    slightly = decide(gen_obs(0, itl=0.3), ttft_first=False)  # not in half for a 20 % overshoot
    assert slightly.knobs.max_batch_tokens == 170 and "max_batch_tokens 256 -> 170" in slightly.reason
    assert decide(gen_obs(0, itl=0.4), ttft_first=False).knobs.max_batch_tokens == 128
    assert decide(gen_obs(0, itl=0.8), ttft_first=False).knobs.max_batch_tokens == 64
    assert decide(gen_obs(0, itl=2.0), ttft_first=False).knobs.max_batch_tokens == 64  # 25 would fit: a quarter at most
    floor = decide(gen_obs(0, itl=0.4), START.replace(max_batch_tokens=40), ttft_first=False)
    assert floor.knobs.max_batch_tokens == 32
    whole = decide(gen_obs(0, itl=0.4), START.replace(max_batch_tokens=0))  # whole prompts: start chunking
    assert whole.knobs.max_batch_tokens == 256


def test_with_ttft_first_the_chunk_is_not_cut_below_what_keeps_prefill_up_with_the_prompts():
    """Each of two workers gets 200 prompt tokens a second and steps every 400 ms on average (the
    mean gap, whatever the chunk while prefill keeps up): 80 tokens a step. A smaller chunk than
    that moves the cost to TTFT without changing the mean gap, so the cut stops at 2 × 80, what
    TTFT's move grows a chunk to when prompts wait; at or under that, the chunk holds and the other
    ITL moves apply (here the layout bet)."""
    far_over = decide(gen_obs(0, itl=0.8, prompt=200))  # 64 alone
    assert far_over.knobs.max_batch_tokens == 160
    assert "down to 160: 2 × the 80 prompt tokens a worker's step must prefill to keep up" in far_over.reason
    at_it = decide(gen_obs(0, itl=0.8, prompt=200), START.replace(max_batch_tokens=160))
    assert at_it.knobs.max_batch_tokens == 160 and (at_it.knobs.process_count, at_it.knobs.threads_per_process) == (1, 2)
    assert "the chunk held at 160" in at_it.reason and "more threads per step" in at_it.reason
    # TTFT over with prompts waiting: the chunk grows to twice what keeps up (in 32s), not only × 2
    grown = decide(gen_obs(0, ttft=3.0, itl=0.1, itl_mean=0.1, waiting=2, prompt=2000), START.replace(max_batch_tokens=64))
    assert grown.knobs.max_batch_tokens == 416 and "prompts wait in the workers" in grown.reason  # 2 × 2000 / 2 × 0.1 = 400


def test_itl_over_at_the_chunk_floor_shrinks_full_batches_else_gives_each_step_more_threads():
    at_floor = START.replace(max_batch_tokens=32)
    full = decide(gen_obs(0, itl=0.4, held=16), at_floor)
    assert full.knobs.max_batch_size == 12 and "fewer rows per step" in full.reason
    not_full = decide(gen_obs(0, itl=0.4, held=4), at_floor)
    assert (not_full.knobs.process_count, not_full.knobs.threads_per_process) == (1, 2)
    decode_only = decide(gen_obs(0, itl=0.4, ttft=None, first_tokens=0, held=4))  # nothing prefilled: the chunk is not it
    assert decode_only.knobs.max_batch_tokens == 256 and decode_only.knobs.process_count == 1


def test_ttft_over_with_itl_headroom_grows_the_chunk_for_waiting_prompts_then_the_batch_then_the_workers():
    queued = gen_obs(0, ttft=3.0, itl=0.1, held=16, queue_depth=5)
    assert decide(queued).knobs.max_batch_size == 20
    at_most = dataclasses.replace(TWO_CORES, max_batch_size=(1, 16))
    one_worker = START.replace(process_count=1, threads_per_process=2)
    more = GeneratePolicy().decide(gen_obs(0, ttft=3.0, itl=0.1, held=16, queue_depth=5, workers=1), one_worker, at_most)
    assert (more.knobs.process_count, more.knobs.threads_per_process) == (2, 1) and "one more worker" in more.reason
    # prompts wait inside a worker for their prefill, even behind full batches: the chunk is what holds them
    for held in (4, 16):
        waiting_in_worker = decide(gen_obs(0, ttft=3.0, itl=0.1, held=held, waiting=2, queue_depth=5), one_worker)
        assert waiting_in_worker.knobs == one_worker.replace(max_batch_tokens=512) and "prompts wait in the workers" in waiting_in_worker.reason
    whole_prompts = one_worker.replace(max_batch_tokens=0)  # nothing larger to give: one more worker
    assert decide(gen_obs(0, ttft=3.0, itl=0.1, held=4, waiting=2), whole_prompts).knobs.process_count == 2


def test_ttft_over_with_nothing_queued_prefills_in_larger_chunks():
    decision = decide(gen_obs(0, ttft=3.0, itl=0.1, held=1))
    assert decision.knobs.max_batch_tokens == 512 and "nothing queues" in decision.reason


def test_ttft_over_without_itl_headroom_holds_and_says_capacity_is_short():
    decision = decide(gen_obs(0, ttft=3.0, itl=0.2, itl_mean=0.21, held=16, queue_depth=5))  # every step slow: no headroom
    assert decision.knobs == START and "capacity short" in decision.reason


def test_with_a_queue_the_itl_tail_yields_to_ttft_while_the_mean_gap_holds():
    """Prefill steps make ITL's tail (p99 300 ms) while the rows keep their pace (mean 120 ms):
    with sequences queued and TTFT over, the chunk is not cut and TTFT's moves go on; without the
    queue, or with ttft_first off, or with the mean over too, ITL p99 is met first as before."""
    tail = dict(itl=0.3, itl_mean=0.12)
    grows = decide(gen_obs(0, ttft=3.0, held=16, queue_depth=5, waiting=2, **tail))
    assert grows.knobs == START.replace(max_batch_tokens=512) and "prompts wait in the workers" in grows.reason
    assert decide(gen_obs(0, ttft=3.0, held=16, queue_depth=5, **tail)).knobs == START.replace(max_batch_size=20)
    calm = decide(gen_obs(0, ttft=1.0, **tail))  # TTFT met with headroom: ITL p99 is the objective to meet
    assert calm.knobs.max_batch_tokens < 256 and "smaller prefill chunks" in calm.reason
    # TTFT met, but without headroom (1.9 s of 2): a smaller chunk would put it over and the next
    # window would grow the chunk back (the live steady replay cycled 85 <-> 170 so): hold
    edge = decide(gen_obs(0, ttft=1.9, **tail))
    assert edge.knobs == START and "TTFT without headroom" in edge.reason
    assert decide(gen_obs(0, ttft=1.9, itl=0.3, itl_mean=0.27)).knobs.max_batch_tokens < 256  # the pace lost: cut all the same
    assert decide(gen_obs(0, ttft=3.0, held=16, queue_depth=5, **tail), ttft_first=False).knobs.max_batch_tokens < 256
    # the pace itself lost (mean 270 ms) with capacity short: a smaller chunk would not bring the mean
    # down, only slow the prefill the queue waits on; with full batches and a queue, hold
    slow = decide(gen_obs(0, ttft=3.0, held=16, queue_depth=5, itl=0.3, itl_mean=0.27))
    assert slow.knobs == START and "capacity short: a smaller chunk would slow the prefill the queue waits on" in slow.reason
    unjudged = decide(gen_obs(0, ttft=None, first_tokens=0, held=16, queue_depth=5, **tail))  # too few first tokens: hold
    assert unjudged.knobs == START and "capacity short" in unjudged.reason


def test_while_requests_arrive_faster_than_they_finish_the_itl_tail_does_not_cut_the_chunk():
    """Live bursts' first windows: 28-29 arrived, 1 finished, TTFT p99 met (late arrivals not served yet), ITL p99
    over; cutting put the next TTFT at 2.3-8.8 s. Arrivals outrunning completions hold ITL's tail; steady or draining, it cuts."""
    burst, at = dict(ttft=0.9, itl=0.62, itl_mean=0.2, arrivals=2.8, completions=0.1, prompt=100), START.replace(max_batch_tokens=128)
    rising = decide(gen_obs(0, **burst), at)
    assert rising.knobs == at and "requests arriving faster than they finish (2.80 against 0.10 a second): capacity short, holding" in rising.reason
    slow = decide(gen_obs(0, **{**burst, "itl_mean": 0.3}, held=16), at)  # the mean gap over too: still no cut
    assert slow.knobs == at and "capacity short" in slow.reason
    for arrivals, completions in ((2.0, 2.0), (2.0, 1.4), (0.6, 4.4)):  # steady (within chance), draining
        cut = decide(gen_obs(0, **{**burst, "arrivals": arrivals, "completions": completions}), at)
        assert cut.knobs.max_batch_tokens < 128 and "smaller prefill chunks" in cut.reason


def test_a_chunk_cut_that_put_ttft_back_over_is_not_made_again_while_the_mean_gap_holds():
    """The live steady replay's cycle (recorded decisions, 2026-12-05): ITL p99 over with TTFT met
    cut the chunk 128 -> 64, TTFT went over, the chunk grew back, and round again eight times in 240 s.
    Growing back right after such a cut sets a floor for retry_seconds: ITL's tail then holds the
    chunk (the mean gap holding); a larger chunk may still be cut down to the floor, and the floor
    ends with retry_seconds. With ttft_first off, the cut is made as before."""
    def run(ttft_first=True, mean=0.12):
        policy = GeneratePolicy(GenerateParams(ttft_first=ttft_first, retry_seconds=300))
        knobs, log = START.replace(max_batch_tokens=128), []
        for t, obs in ((0, gen_obs(0, ttft=1.08, itl=0.4, itl_mean=mean, prompt=200)),    # TTFT met with headroom: ITL cuts
                       (15, gen_obs(15, ttft=3.3, itl=0.15, waiting=2, prompt=200)),     # the cut put TTFT over: grow back
                       (30, gen_obs(30, ttft=0.7, itl=0.4, itl_mean=mean, prompt=200))):   # ITL's tail over again
            decision = policy.decide(obs, knobs, TWO_CORES)
            knobs = decision.knobs
            log.append((knobs.max_batch_tokens, decision.reason))
        return policy, knobs, log
    policy, knobs, log = run()
    assert [chunk for chunk, _ in log] == [64, 128, 128]
    assert "the cut to 64 put TTFT over: no cut under 128 for 300 s" in log[1][1]
    assert "the chunk held at 128 (a chunk under it put TTFT over, 285 s more); its mean within the objective: holding" in log[2][1]
    # a larger chunk is cut no further than the floor; after retry_seconds the floor is gone
    far = policy.decide(gen_obs(45, ttft=0.7, itl=0.8, itl_mean=0.12, prompt=200), knobs.replace(max_batch_tokens=256), TWO_CORES)  # 64 alone
    assert far.knobs.max_batch_tokens == 128
    assert policy.decide(gen_obs(400, ttft=0.7, itl=0.4, itl_mean=0.12, prompt=200), knobs, TWO_CORES).knobs.max_batch_tokens == 64
    # the pace itself lost (mean 270 ms): the cut stops at twice what keeps prefill up (2 × 200 × 0.27 = 108),
    # the growth back goes past the chunk cut from (216), and the next cut stops at that chunk, where TTFT was met
    slow = run(mean=0.27)[2]
    assert [chunk for chunk, _ in slow] == [108, 216, 128] and "(down to 128: a chunk under it put TTFT over, 285 s more)" in slow[2][1]
    off = run(ttft_first=False)[2]
    assert [chunk for chunk, _ in off] == [64, 128, 64] and "no cut under" not in off[1][1]


def test_a_chunk_cut_for_a_burst_goes_back_once_the_load_has_gone_unless_the_cut_comes_straight_back():
    """The live bursty replay (2026-12-05, burstQ1): ITL cut the chunk 128 -> 83 as the first burst
    ended and the second burst met 83 (TTFT p99 4.3 s). Once both objectives are met with headroom
    and nothing queues, the chunk goes back to where the first cut came from; not while ITL or TTFT
    lacks headroom or sequences queue. If ITL cuts again right after, the load needs the cut: no
    restore for retry_seconds."""
    policy = GeneratePolicy(GenerateParams(retry_seconds=300))
    knobs = START.replace(max_batch_tokens=128)
    steps = [(0, gen_obs(0, ttft=1.08, itl=0.4, itl_mean=0.11, prompt=100)),   # the burst's end: ITL cuts
             (15, gen_obs(15, ttft=0.6, itl=0.2, itl_mean=0.1)),                 # ITL without headroom (> 175 ms): hold
             (30, gen_obs(30, ttft=0.4, itl=0.15, queue_depth=2)),               # sequences queue: hold
             (45, gen_obs(45, ttft=0.4, itl=0.15)),                              # quiet: back to 128
             (60, gen_obs(60, ttft=0.4, itl=0.15))]                              # at home: hold
    chunks, reasons = [], []
    for t, obs in steps:
        decision = policy.decide(obs, knobs, TWO_CORES)
        knobs = decision.knobs
        chunks.append(knobs.max_batch_tokens)
        reasons.append(decision.reason)
    assert chunks == [64, 64, 64, 128, 128]
    assert "nothing queued: the chunk ITL cut goes back to 128" in reasons[3]
    # cut again within two windows of the restore: the load needs it, and the chunk stays down
    cut = policy.decide(gen_obs(70, ttft=1.0, itl=0.4, itl_mean=0.11, prompt=100), knobs, TWO_CORES).knobs
    assert cut.max_batch_tokens == 64
    assert policy.decide(gen_obs(100, ttft=0.4, itl=0.15), cut, TWO_CORES).knobs == cut
    assert policy.decide(gen_obs(400, ttft=0.4, itl=0.15), cut, TWO_CORES).knobs.max_batch_tokens == 128  # retry_seconds later


def test_over_requests_the_itl_objective_judges_each_requests_mean_gap():
    """A 256-token chunk makes one 600-ms step per prompt among 150-ms ones: the gaps' p99 is over
    250 ms, but each request's time per output token (TPOT) is 170 ms. Over tokens the chunk is
    cut; over requests nothing is over. With too few finished requests, the mean gap stands in."""
    def obs(tpot_p99, finished=20):
        o = gen_obs(0, ttft=0.8, itl=0.6, itl_mean=0.16)
        latency = {**o.load.latency, "tpot": Latency(p50=0.16, p95=0.17, p99=tpot_p99, mean=0.16, count=finished)}
        return dataclasses.replace(o, load=dataclasses.replace(o.load, latency=latency))
    assert decide(obs(0.17)).knobs.max_batch_tokens < 256  # tokens, the default
    met = decide(obs(0.17), itl_p99_over="requests")
    assert met.knobs == START and "TPOT p99 170 ms of 250 ms" in met.reason and "holding" in met.reason
    assert decide(obs(0.4), itl_p99_over="requests").knobs.max_batch_tokens < 256  # some requests' pace is lost
    few = decide(obs(0.4, finished=2), itl_p99_over="requests")
    assert few.knobs == START and "mean ITL (too few finished for TPOT p99) 160 ms" in few.reason


def test_a_change_is_followed_by_a_cooldown():
    policy = GeneratePolicy(GenerateParams(cooldown_seconds=10))
    first = policy.decide(gen_obs(0, itl=0.4, prompt=200), START, TWO_CORES)
    assert first.knobs != START
    assert policy.decide(gen_obs(5, itl=0.4, prompt=200), first.knobs, TWO_CORES).knobs == first.knobs
    assert policy.decide(gen_obs(11, itl=0.4, prompt=200), first.knobs, TWO_CORES).knobs != first.knobs


def test_a_queueing_load_settles_on_the_largest_batch_whose_itl_meets_the_objective():
    """A plant where a decode step costs 100 ms + 5 ms per running sequence (its weight reads
    dominate: each growth makes more tokens a second) and the queue stays until the batch reaches
    28 (every step alike, so the mean gap is the p99): the batch grows while ITL has headroom, each
    growth a bet that pays, then holds, never cycling."""
    policy = GeneratePolicy()
    knobs = START.replace(max_batch_size=4)
    sizes = []
    for step in range(60):
        size = knobs.max_batch_size
        itl = 0.1 + 0.005 * size
        decision = policy.decide(gen_obs(step * 5.0, ttft=3.0 if size < 28 else 1.0, itl=itl, itl_mean=itl, held=size, queue_depth=5,
                                         tokens=int(2 * size / itl * 10)), knobs, TWO_CORES)
        knobs = decision.knobs
        sizes.append(knobs.max_batch_size)
    assert sizes[-1] == 24 and sizes[-20:] == [24] * 20  # 100 ms + 120 ms = 220 ms > 0.8 × 250 ms (mean_headroom): stop growing
    assert sizes == sorted(sizes)


def recorded() -> list[tuple[str, Knobs, Observation]]:
    """SmolLM2 on this 2-core machine, 1 × 2 threads, 16 sequences, 512-token chunks: one client
    (32-token prompts), then eight (256-token prompts), shared with other busy processes
    (benchmarks/record_gen_observations.py; tests/fixtures/README.md): (phase, knobs, Observation)."""
    with open(FIXTURE, encoding="utf-8") as f:
        records = json.load(f)
    out = []
    for r in records:
        load = r["load"]
        latency = {stage: Latency(**values) for stage, values in load.pop("latency").items()}
        workers = tuple(WorkerObservation(pid=None, **w) for w in r["workers"])
        out.append((r["phase"], Knobs(**r["knobs"]), Observation(r["time"], 10.0, Load(latency=latency, **load), workers)))
    return out


def test_replaying_a_recorded_generation_run_bets_on_the_layout_once_and_changes_nothing_else():
    """ITL p99 is over 250 ms all through (0.4–8 s: a slow, shared CPU), but one worker already
    has both cores, batches are far from full and 32-token prompts never fill a 512-token chunk.
    The one move left is splitting the rows over two workers: made once, judged on the next
    window wholly after it (ITL p50 450 ms against 169 ms: it did not pay), undone, and not made again within
    retry_seconds; the chunk and the batch never change. Each decision's knobs are fed back."""
    policy = GeneratePolicy()
    start = knobs = recorded()[0][1]
    changes, reasons = [], []
    for _, _, observation in recorded():
        decision = policy.decide(observation, knobs, TWO_CORES)
        if decision.knobs != knobs:
            changes.append((decision.knobs.process_count, decision.knobs.threads_per_process))
        knobs = decision.knobs
        assert (knobs.max_batch_size, knobs.max_batch_tokens, knobs.kv_tokens) == (start.max_batch_size, start.max_batch_tokens, start.kv_tokens)
        reasons.append(decision.reason)
    assert changes == [(2, 1), (1, 2)] and knobs == start
    held = [r for r in reasons if "did not pay last time" in r]
    assert len(held) > 20 and all(r.endswith("holding: no change") for r in held)


def test_on_the_recorded_burst_prompts_waiting_in_the_worker_make_the_chunk_shrink():
    """Eight 256-token prompts at once: six wait in the worker while steps prefill 512 tokens each
    and ITL p99 is 6.2 s. Judged on that window (it holds only 10 inter-token latencies, so the
    shipped min_tokens of 20 holds there), the prompts waiting fill the chunk: cut it, in
    proportion to the overshoot but to a quarter at most in one move (without ttft_first; with it,
    the prompts waiting make capacity short and the chunk stays)."""
    (observation, knobs), = [(o, k) for phase, k, o in recorded() if phase == "heavy" and o.workers[0].waiting_sequences == 6][:1]
    decision = GeneratePolicy(GenerateParams(min_tokens=5, ttft_first=False)).decide(observation, knobs, TWO_CORES)
    assert decision.knobs == knobs.replace(max_batch_tokens=128) and "smaller prefill chunks" in decision.reason
    # with ttft_first, prompts waiting are a queue: capacity is short, so the chunk stays and the one
    # worker that has both threads bets on a second one instead
    queued = GeneratePolicy(GenerateParams(min_tokens=5)).decide(observation, knobs, TWO_CORES)
    assert queued.knobs == knobs.replace(process_count=2, threads_per_process=1) and "the chunk held at 512 (capacity short" in queued.reason


def test_itl_over_with_prompts_that_never_fill_the_chunk_leaves_the_chunk_alone():
    decision = decide(gen_obs(0, itl=0.4, prompt=40, held=4))  # 40-token prompts, ~80 per step: a 128-token chunk changes nothing
    assert decision.knobs.max_batch_tokens == 256 and decision.knobs.process_count == 1


def test_itl_and_ttft_both_over_with_full_batches_hold_rather_than_cut_throughput():
    at_floor = START.replace(max_batch_tokens=32)
    decision = decide(gen_obs(0, itl=0.4, itl_mean=0.3, ttft=3.0, held=16, queue_depth=5), at_floor)
    assert decision.knobs == at_floor and "capacity short" in decision.reason
    queued = decide(gen_obs(0, itl=0.4, itl_mean=0.3, ttft=None, first_tokens=0, held=16, queue_depth=3), at_floor)  # too few first tokens to judge TTFT
    assert queued.knobs == at_floor and "capacity short" in queued.reason
