"""Generation: the process × thread layout, running sequences, prompt tokens per step and the KV
cap, tuned against a TTFT p99 and an ITL (inter-token latency) p99 objective.

Each decision reads the window's TTFT and ITL p99s and the workers' sequences and KV figures and
makes at most one move, the first of these that applies. "TTFT over" below also means more than
1 % of the window's requests refused with a 429 (the admission limit, or shed after
limits.queue_timeout_seconds): a queue limit short of the objective keeps the served requests'
TTFT under it while the refused ones miss it for good.

1. too few inter-token latencies in the window (`min_tokens`), or a change younger than
   `cooldown_seconds`: hold, nothing measured under the current knobs yet;
2. preemptions in the window: the KV cap thrashes (each one recomputes a sequence). If the
   kv_tokens knob is what binds (set, and the workers run at it, below their ceiling), double it
   (up to 0, the whole ceiling); else, if max_batch_size lets in more rows than the fullest
   worker's cache holds at its rows' current width (with 10 % to spare), fewer running sequences:
   down to that, by at most decrease_factor a decision; else hold (the rows outgrew the cache
   while running: the preemptions themselves bring it back);
3. ITL p99 over its objective: a decode step is too slow. With `ttft_first`, while capacity is
   short (TTFT over, or sequences queued with too few first tokens to judge it, or requests
   arriving faster than they finish beyond a window's chance: a load rising, which TTFT p99, over
   the first tokens already made, shows only a window later) or TTFT has no headroom (p99 >
   `headroom` × its objective: a smaller chunk would put it over, and the next window would
   grow the chunk back), and the mean gap is within the objective, ITL yields:
   TTFT's moves (4.) decide when TTFT is over, else the policy holds. Else, if the prompt tokens
   one step prefills (a mean prompt, the prompt tokens arriving during one step, or those waiting
   in the workers) pass half of max_batch_tokens, cut it in proportion to the overshoot: to the
   chunk whose step would put ITL p99 at 0.8 × its objective (a step that prefills a whole chunk
   is the slow one), to a quarter at most, not below `min_batch_tokens` (a chunk prompts never
   fill would change nothing). With `ttft_first` the cut has a floor, the larger of: 2 × the
   prompt tokens a worker's step must prefill to keep up with the window's arrivals (a smaller
   chunk changes the tail, not the mean gap, until prefill falls behind: then the cost moves to
   TTFT; and 2 × is what TTFT's move grows a chunk to when prompts wait), and, for `retry_seconds`,
   a chunk whose cut put TTFT over (TTFT's next move grew it back). At the floor, a mean gap within
   the objective holds; else the moves below apply;
   else, with full batches, fewer running sequences (a step's cost grows with its rows) unless TTFT is over too,
   or too few first tokens to judge it while sequences queue (capacity is short: fewer rows would
   only lengthen the queue; hold); else, with `ttft_first` and capacity short, hold (fewer
   workers make no more tokens a second); else, while requests finish faster than they arrive
   beyond chance (a burst's backlog draining), hold; else more threads per worker and fewer workers
   (the same rows on more cores). That last move is a bet: whether a step of more threads is faster
   depends on the CPU and the model (SmolLM2 on two EPYC cores decodes no faster on 1 × 2 than
   on 2 × 1). It is judged on the first window measured wholly after it (the policy holds till
   then): unless ITL p50 fell by `min_layout_gain` or the ITL objective is met, the layout goes
   back and the bet is not made again for `retry_seconds`.
   One worker that has every thread already makes the opposite bet, judged the same way: one
   more worker, the rows split over both;
4. TTFT p99 over its objective while ITL has headroom (p99 <= `headroom` × objective; with
   `ttft_first` and sequences queued, a mean gap <= `mean_headroom` × objective will do): when
   prompts wait inside the workers for more prefill than one chunk holds (a mean prompt each),
   larger prefill chunks (× 2: fewer weight reads per prompt token; with `ttft_first`, at least
   twice what keeps up with the arrivals); when sequences queue (in the front or in a worker) and batches are full, a larger batch (+
   `growth_step`; continuous batching makes more tokens per second at a larger batch while a step's
   cost is mostly its weight reads, not once the rows fill the cores: a bet, kept if the busy cores
   per output token fell by `min_rows_gain` of 1 - rows before / rows after and the ITL objective
   still holds (it was made on ITL's headroom), undone without a verdict if the load no longer fills it), else one more worker, the cores spread over them; when nothing queues, the prompt itself is slow to
   prefill: a larger max_batch_tokens (fewer steps per prompt). Without ITL headroom capacity is
   short: with sequences queued and more than one thread per worker, one more worker, else hold
   and say so. One more worker that takes threads from the others is a bet too (fewer threads
   per step may cost ITL, or nothing where steps do not speed up with threads): kept if the
   cores busy per output token fell by `min_layout_gain` or nothing queues any more, else undone;
5. both met with headroom (p99s <= `headroom` × their objectives), nothing queued or rising, and ITL
   cut the chunk: back to the chunk its first cut came from, but no larger than the chunk in force
   in the last such calm window before the cut (the chunk the burst began with: a cut made for one
   burst must not meet the next, nor a chunk TTFT doubled for it); a cut that comes straight back
   keeps the chunk down for `retry_seconds`;
6. otherwise hold (both met).

The threads a layout spreads over are the bounds' most threads per worker (the controller sets
it to the usable cores). Only the knobs named here change; batch_timeout and io_threads pass through.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import Decision, Params, clamp_knob, describe_changes
from policies.gen_bet import Bets
from policies.gen_load import (chunk_binds, chunk_size, falling, is_queueing, keep_up_tokens, ms, prefill_per_step, rates, ready_workers,
                               refused_share, rising)

REFUSED_LATE = 0.01
"""A share of the window's requests refused (429) above this counts as TTFT over: what a p99 objective lets be late."""
KEEP_UP_MARGIN = 2.0
"""A chunk this many times what keeps prefill up with the arrivals: what TTFT grows a chunk to when
prompts wait (the backlog drains too), and, with ttft_first, the least ITL may cut it to."""


class GenerateParams(Params):
    ttft_p99_seconds: float = Field(2.0, gt=0)
    """Time to first token objective (p99, seconds)."""
    itl_p99_seconds: float = Field(0.25, gt=0)
    """Inter-token latency objective (p99, seconds)."""
    itl_p99_over: Literal["tokens", "requests"] = "tokens"
    """What the ITL objective's p99 is over: every gap between two tokens, or each finished request's
    mean gap (time per output token, TPOT: what goodput counts; a prefill's stall then costs the
    request its share of it, not a whole p99 sample). Fewer than min_requests finished: the mean gap."""
    min_tokens: int = Field(20, ge=1)
    """Inter-token latencies the window needs before the policy acts."""
    min_requests: int = Field(5, ge=1)
    """First tokens the window needs before TTFT is judged."""
    headroom: float = Field(0.7, gt=0, le=1)
    """Grow (batch, workers, chunk) for TTFT only while ITL p99 <= headroom × its objective."""
    decrease_factor: float = Field(0.75, gt=0, lt=1)
    """max_batch_size is multiplied by this to shrink (down by at least 1)."""
    growth_step: int = Field(4, ge=1)
    """Running sequences added when TTFT is over from queueing and batches are full."""
    fill_threshold: float = Field(0.8, gt=0, le=1)
    """Batches are full when the ready workers hold on average >= this × max_batch_size sequences."""
    min_batch_tokens: int = Field(32, ge=1)
    """max_batch_tokens is never cut below this."""
    cooldown_seconds: float = Field(10.0, ge=0)
    """Hold this long after a change, so the window measures the new knobs (one sampler window)."""
    min_layout_gain: float = Field(0.1, ge=0, lt=1)
    """A layout bet stays only if ITL p50 (more threads) or the busy cores per output token (more workers) then fall by this share."""
    min_rows_gain: float = Field(0.25, ge=0, le=1)
    """A larger batch stays only if the busy cores per output token then fall by this share of
    1 - rows before / rows after (what they would fall by if a step cost the same whatever its rows),
    and the ITL objective still holds."""
    retry_seconds: float = Field(300.0, ge=0)
    """How long a bet (a layout, a larger batch) that did not pay is not made again."""
    mean_headroom: float = Field(0.8, gt=0, le=1)
    """With ttft_first and sequences queued, grow for TTFT while the mean inter-token gap <= this × the ITL objective."""
    ttft_first: bool = True
    """When capacity is short (TTFT over, sequences queue, or arrivals outrun completions) or TTFT has no headroom, ITL p99 yields
    to TTFT while the mean inter-token gap holds: the chunk is not cut, and TTFT's moves may grow it."""


class GeneratePolicy:
    """TTFT and ITL objectives -> layout, running sequences, step token budget and KV cap."""

    kind = "generate"

    def __init__(self, params: GenerateParams | None = None):
        self.params = params if params is not None else GenerateParams()
        self.name = self.kind
        self._changed_at: float | None = None
        self._bets = Bets(self.params.min_layout_gain, self.params.min_rows_gain, self.params.retry_seconds)
        self._cut: tuple[int, int] | None = None
        """(from, to) of max_batch_tokens when the last change was ITL cutting the chunk."""
        self._chunk_floor: tuple[int, float] | None = None
        """(chunk, until): a cut below this chunk put TTFT back over; with ttft_first, ITL does not cut under it till then."""
        self._chunk_home: int | None = None
        """The chunk ITL's first cut (of a run of cuts) came from, until the chunk is back at it."""
        self._calm_chunk: int | None = None
        """The chunk in force in the last calm window (both met with headroom, nothing queued or
        rising) with no cut outstanding: the chunk a burst began with."""
        self._restored_at = float("-inf")
        self._no_restore_until = float("-inf")
        """A cut that came right after a restore: the load needs it, no restore till then."""

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        p = self.params
        self._bets.settle(observation.time)
        itl = observation.load.latency.get("itl")
        if itl is None or itl.count < p.min_tokens or itl.p99 is None:
            return Decision(knobs, f"{itl.count if itl else 0} of {p.min_tokens} inter-token latencies in the window: holding")
        if self._changed_at is not None and observation.time - self._changed_at < p.cooldown_seconds:
            return Decision(knobs, f"cooldown after the last change ({p.cooldown_seconds:g}s): holding")
        ttft = observation.load.latency.get("ttft")
        ttft_p99 = ttft.p99 if ttft is not None and ttft.count >= p.min_requests else None
        tail, tail_name = self._itl_tail(observation)
        state = f"TTFT p99 {ms(ttft_p99)} of {ms(p.ttft_p99_seconds)}, {tail_name} {ms(tail)} of {ms(p.itl_p99_seconds)}"
        refused = refused_share(observation)
        if refused:
            state += f", {refused:.0%} refused"
        # A p99 objective lets 1 % be late; more refused than that is TTFT over, however fast the rest were.
        ttft_over = (ttft_p99 is not None and ttft_p99 > p.ttft_p99_seconds) or refused > REFUSED_LATE
        # Too few first tokens to judge TTFT (a slow, queued engine makes few): a queue says the same.
        # Arrivals outrunning completions say it before TTFT does: the first tokens of a burst's late
        # arrivals are not made yet (live, ITL's cuts at a burst's start put TTFT over a window later).
        short = ttft_over or (ttft_p99 is None and is_queueing(observation)) or rising(observation)
        calm = self._calm(observation, tail, ttft_p99)
        move = (
            self._judge_bet(observation, knobs, ttft_over, tail, tail_name)
            or self._kv_thrash(observation, knobs, bounds)
            or (self._itl_over(observation, knobs, bounds, short, ttft_p99) if tail > p.itl_p99_seconds else None)
            or (self._ttft_over(observation, knobs, bounds, tail) if ttft_over else None)
            or (self._restore_chunk(observation, knobs, bounds) if calm else None)
        )
        if calm and self._chunk_home is None:
            self._calm_chunk = (move[0] if move is not None else knobs).max_batch_tokens
        if move is None:
            return Decision(knobs, f"{state}: holding")
        proposal, why = move
        changes = describe_changes(knobs, proposal)
        if not changes:
            return Decision(knobs, f"{state}; {why}: no change")
        self._changed_at = observation.time
        cut = chunk_size(proposal.max_batch_tokens) < chunk_size(knobs.max_batch_tokens)
        self._cut = (knobs.max_batch_tokens, proposal.max_batch_tokens) if cut else None
        if cut and observation.time - self._restored_at <= p.cooldown_seconds + 2 * observation.window_seconds:
            self._no_restore_until = observation.time + p.retry_seconds
        if cut and self._chunk_home is None:
            self._chunk_home = knobs.max_batch_tokens
        elif self._chunk_home is not None and chunk_size(proposal.max_batch_tokens) >= chunk_size(self._chunk_home):
            self._chunk_home = None
        return Decision(proposal, f"{state}; {why}: {changes}")

    def _calm(self, observation: Observation, tail: float, ttft_p99: float | None) -> bool:
        """Both objectives met with headroom, nothing queued, requests not arriving faster than they finish."""
        p = self.params
        if is_queueing(observation) or rising(observation) or refused_share(observation) or tail > p.headroom * p.itl_p99_seconds:
            return False
        return ttft_p99 is None or ttft_p99 <= p.headroom * p.ttft_p99_seconds

    def _restore_chunk(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> tuple[Knobs, str] | None:
        """A calm window after ITL cut the chunk: back to the chunk it was cut from, but no larger
        than the chunk the burst began with. A cut made for a burst's load would otherwise outlive it
        and slow the next burst's prefill (the live bursty replay cut 128 -> 83 at a burst's end and
        met the next burst at 83, TTFT p99 4.3 s); a chunk TTFT doubled during the burst would meet
        the next one whole (live: 112 -> 224 in a burst, cut, and restored to 224 after it). A cut
        that comes straight back after a restore stays for retry_seconds."""
        home = self._chunk_home
        if home is None or observation.time < self._no_restore_until:
            return None
        if self._calm_chunk is not None and chunk_size(self._calm_chunk) < chunk_size(home):
            home = self._calm_chunk
        if chunk_size(home) <= chunk_size(knobs.max_batch_tokens):
            self._chunk_home = None  # the chunk is at or above where the burst began: nothing to restore
            return None
        self._restored_at, self._chunk_home = observation.time, None
        return knobs.replace(max_batch_tokens=clamp_knob(bounds, "max_batch_tokens", home)), f"both objectives met with headroom (× {self.params.headroom:g}), nothing queued: the chunk ITL cut goes back to {home}"

    def _itl_tail(self, observation: Observation) -> tuple[float, str]:
        """The p99 the ITL objective judges (itl_p99_over), and its name."""
        itl, tpot = observation.load.latency["itl"], observation.load.latency.get("tpot")
        if self.params.itl_p99_over == "tokens":
            return itl.p99, "ITL p99"
        if tpot is not None and tpot.count >= self.params.min_requests and tpot.p99 is not None:
            return tpot.p99, "TPOT p99"
        # Too few requests finished to judge their p99: the mean gap is what their means average to.
        return (itl.mean if itl.mean is not None else itl.p99), "mean ITL (too few finished for TPOT p99)"

    def _kv_thrash(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> tuple[Knobs, str] | None:
        ready = ready_workers(observation)
        preempted = sum(w.preemptions for w in ready)
        if not preempted:
            return None
        why = f"{preempted} preemptions in the window"
        running_at = max((w.kv_tokens_total for w in ready), default=0)
        if knobs.kv_tokens and running_at >= knobs.kv_tokens:
            return knobs.replace(kv_tokens=clamp_knob(bounds, "kv_tokens", knobs.kv_tokens * 2)), f"{why}, the KV cap binds"
        fullest = max(ready, key=lambda w: w.kv_tokens_used)
        if not fullest.running_sequences or not fullest.kv_tokens_used or not fullest.kv_tokens_total:
            return self._fewer_sequences(knobs, bounds), f"{why} at the KV ceiling"
        width = fullest.kv_tokens_used / fullest.running_sequences
        fits = max(1, int(0.9 * fullest.kv_tokens_total / width))
        if knobs.max_batch_size <= fits:
            return None  # the limit already fits the cache: the rows grew into it, preemption copes
        smaller = max(fits, int(knobs.max_batch_size * self.params.decrease_factor))
        return knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", smaller)), f"{why}: {fits} rows of {width:.0f} slots fit the KV cache"

    def _itl_over(self, observation: Observation, knobs: Knobs, bounds: Bounds, short: bool, ttft_p99: float | None) -> tuple[Knobs, str] | None:
        p, itl = self.params, observation.load.latency["itl"]
        # TTFT without headroom: a cut chunk would put it over and the next window would grow it back.
        tight = ttft_p99 is not None and ttft_p99 > p.headroom * p.ttft_p99_seconds
        if (short or tight) and p.ttft_first and itl.mean is not None and itl.mean <= p.itl_p99_seconds:
            # A queued request that misses its first-token objective is lost whole; a stream that
            # stalls now and then while a chunk prefills keeps its pace on average. TTFT decides.
            if ttft_p99 is not None and ttft_p99 > p.ttft_p99_seconds:
                return None
            if tight:
                return knobs, f"ITL over but its mean within the objective, TTFT without headroom (> {p.headroom:g} × its objective): holding"
            if rising(observation):
                return knobs, f"ITL over but its mean within the objective, requests arriving faster than they finish ({rates(observation)}): capacity short, holding"
            return knobs, "ITL over but its mean within the objective, sequences queued, too few first tokens to judge TTFT: capacity short, holding"
        chunk = knobs.max_batch_tokens
        half = max(p.min_batch_tokens, chunk // 2) if chunk else 256  # 0 prefilled whole prompts: start chunking
        floor, floor_why = self._chunk_floor_now(observation) if p.ttft_first else (0, "")
        if p.ttft_first and short:
            # The mean gap is over too, but a smaller chunk would not bring it down (the same prompt
            # tokens are prefilled a second either way); it would only slow the prefill a queue waits on.
            floor, floor_why = chunk_size(chunk), "capacity short: a smaller chunk would slow the prefill the queue waits on, not the mean gap"
        held = ""
        if (chunk == 0 or chunk > p.min_batch_tokens) and prefill_per_step(observation) > half:
            if chunk_size(chunk) > floor:
                # ITL p99 is a step that prefilled a whole chunk: scale the chunk to what fits 80 % of the
                # objective, to a quarter at most (a shared CPU's stalls count in that p99 too). Not at
                # least in half: live, ITL p99s 4-18 % over in bursts cut 128 -> 69-86, and twice the
                # next window's TTFT went over (2.3 and 3.6 s) as prefill fell behind.
                fits = int(chunk * 0.8 * p.itl_p99_seconds / itl.p99) if chunk else half
                smaller = max(p.min_batch_tokens, floor, chunk // 4, fits)  # fits < 0.8 × chunk: a cut of a fifth at least
                why = "ITL over with prompts prefilling: smaller prefill chunks" + (f" (down to {floor}: {floor_why})" if smaller == floor else "")
                return knobs.replace(max_batch_tokens=clamp_knob(bounds, "max_batch_tokens", smaller)), why
            # A smaller chunk moves the tail, not the mean gap (the same prompt tokens are prefilled
            # a second either way), until prefill falls behind: then it only moves the cost to TTFT.
            held = f"ITL over, the chunk held at {chunk} ({floor_why}); "
            if itl.mean is not None and itl.mean <= p.itl_p99_seconds:
                return knobs, held + "its mean within the objective: holding"  # the tail alone is not worth a layout bet
        if self._batches_full(observation, knobs):
            if short:  # fewer rows would cut the tokens per second that a queue already lacks
                return knobs, held + "ITL over with full batches and TTFT over (or sequences queued): capacity short, holding"
            return self._fewer_sequences(knobs, bounds), held + "ITL over with full batches: fewer rows per step"
        if self._layout(knobs, bounds, knobs.process_count - 1) == knobs and knobs.threads_per_process > 1:
            # No more threads to give a step: split the rows over more workers instead, judged the same way.
            return self._bet_on_layout(observation, knobs, bounds, "workers", "itl", held + "ITL over, no more threads to give a step: one more worker, fewer rows each")
        if p.ttft_first and short:
            # Fewer workers with more threads each may make a step faster, but not more tokens a
            # second, which a queue lacks; and judged on ITL p50 it would look paid as the burst
            # that made the queue ends (the live bursts went 2 × 1 -> 1 × 2 at their height and held it).
            return knobs, held + "ITL over with capacity short: no fewer workers while sequences queue, holding"
        if falling(observation):
            # A burst's backlog draining: its ITL p99 is the burst's, and ITL p50 after the move would
            # be the quiet's, so the bet would look paid whatever it did (simulated, 2 × 1 -> 1 × 2 so
            # at a burst's end met the next burst on one worker and lost a third of the run's goodput).
            return knobs, held + f"ITL over while requests finish faster than they arrive ({rates(observation)}): the load that made it is leaving, holding"
        return self._bet_on_layout(observation, knobs, bounds, "threads", "itl", held + "ITL over: more threads per step")

    def _bet_on_layout(self, observation: Observation, knobs: Knobs, bounds: Bounds, kind: str, metric: str, why: str) -> tuple[Knobs, str]:
        """A layout move whose gain depends on the CPU and the model: made, then judged on `metric`
        ("itl": ITL p50 must fall, "cost": busy core-seconds per output token must fall)."""
        if blocked := self._bets.blocked(kind, observation.time):
            return knobs, f"{why} {blocked}: holding"
        moved = self._layout(knobs, bounds, knobs.process_count + (1 if kind == "workers" else -1))
        if moved.threads_per_process == knobs.threads_per_process:
            # More workers on cores that were idle: no bet. Fewer workers with no more threads each: no gain.
            return (moved, why) if kind == "workers" else (knobs, f"{why}: no more threads to give it, holding")
        self._bets.make(observation, kind, metric, knobs, moved)
        return moved, why

    def _judge_bet(self, observation: Observation, knobs: Knobs, ttft_over: bool, tail: float, tail_name: str) -> tuple[Knobs, str] | None:
        """A bet on more workers was made for capacity: it stays when nothing queues and TTFT is not
        over (the offered load may have fallen too, which a cost per token may not show at once). A
        bet for ITL stays when `tail` meets the ITL objective (ITL p50 on fewer threads a step may
        stay above what it was: the live steady replay undid 1 × 2 -> 2 × 1 at an ITL p99 of 233 of
        250 ms, its p50 98 against 64 ms measured at a lighter load, and lost 11 % of goodput)."""
        bet = self._bets.open
        if bet is None:
            return None
        pace_lost = ""
        if bet.kind == "rows":
            served = False  # a larger batch stays only for the tokens it adds: a queue may empty for other reasons
            if tail > self.params.itl_p99_seconds:  # made on ITL's headroom; live, 20 rows kept for their cost per token lost many requests' pace
                pace_lost = f"{tail_name} {ms(tail)} of {ms(self.params.itl_p99_seconds)}"
        elif bet.metric == "cost":
            served = not ttft_over and not is_queueing(observation)
        else:
            served = tail <= self.params.itl_p99_seconds
        return self._bets.judge(observation, knobs, served, self._batches_full(observation, knobs), pace_lost)

    def _ttft_over(self, observation: Observation, knobs: Knobs, bounds: Bounds, tail: float) -> tuple[Knobs, str]:
        p, itl = self.params, observation.load.latency["itl"]
        queueing = is_queueing(observation)
        room = p.headroom * p.itl_p99_seconds
        # With ttft_first, a queue may spend ITL's tail, and the mean up to mean_headroom, on TTFT:
        # every queued request is late already, while a stream is judged by its mean gap.
        if tail > room and not (p.ttft_first and queueing and itl.mean is not None and itl.mean <= p.mean_headroom * p.itl_p99_seconds):
            why = f"TTFT over but ITL has no headroom (> {self.params.headroom:g} × its objective): capacity short"
            if queueing and knobs.threads_per_process > 1:
                # Fewer threads per step may cost ITL, or nothing where a step does not speed up with
                # threads (SmolLM2 on two EPYC cores): then two workers decode twice the rows. A bet.
                return self._bet_on_layout(observation, knobs, bounds, "workers", "cost", f"{why}, sequences queue: one more worker")
            return knobs, f"{why}, holding"
        chunk = knobs.max_batch_tokens * 2 if knobs.max_batch_tokens else 0
        if chunk_binds(observation, knobs.max_batch_tokens) and chunk and chunk <= bounds.max_batch_tokens[1]:
            # Prompts wait inside the workers for more prefill than a chunk holds: larger chunks read
            # the weights fewer times per prompt token, so the workers prefill more tokens a second.
            # (Only those: simulated, "a prompt waits" alone doubled 768 -> 12288 as each step's
            # newest arrival waited for the next step, and ITL p99 stayed at 390-410 ms.)
            keep_up = KEEP_UP_MARGIN * keep_up_tokens(observation) if self.params.ttft_first else 0
            if keep_up > chunk:  # at least twice what keeps pace with the arrivals, so the backlog drains too
                chunk = clamp_knob(bounds, "max_batch_tokens", -(-int(keep_up) // 32) * 32)
            return knobs.replace(max_batch_tokens=chunk), "TTFT over, prompts wait in the workers: larger prefill chunks" + self._floor_at(observation, chunk)
        full = self._batches_full(observation, knobs)
        if queueing and full and knobs.max_batch_size < bounds.max_batch_size[1]:
            why = "TTFT over, sequences queue behind full batches: a larger batch"
            # A bet too: more rows make more tokens a second only while a step's cost is mostly its
            # weight reads; live, 16 -> 20 rows on two cores made none more and slowed every step.
            if blocked := self._bets.blocked("rows", observation.time):
                return knobs, f"{why} {blocked}: holding"
            grown = knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", knobs.max_batch_size + self.params.growth_step))
            self._bets.make(observation, "rows", "cost", knobs, grown)
            return grown, why
        if queueing:
            return self._bet_on_layout(observation, knobs, bounds, "workers", "cost", "TTFT over, sequences queue: one more worker")
        grown = clamp_knob(bounds, "max_batch_tokens", chunk)
        return knobs.replace(max_batch_tokens=grown), "TTFT over, nothing queues: larger prefill chunks" + self._floor_at(observation, grown)

    def _floor_at(self, observation: Observation, grown: int) -> str:
        """TTFT over right after ITL cut the chunk: that cut put it over, so the chunk stays at `grown`
        (or the chunk cut from, if smaller) or more for retry_seconds (with ttft_first). Says so, or ""."""
        if not self.params.ttft_first or self._cut is None:
            return ""
        floor = grown if chunk_size(grown) <= chunk_size(self._cut[0]) else self._cut[0]  # TTFT was met at the chunk cut from
        self._chunk_floor = (floor, observation.time + self.params.retry_seconds)
        return f" (the cut to {self._cut[1]} put TTFT over: no cut under {floor} for {self.params.retry_seconds:g} s)"

    def _chunk_floor_now(self, observation: Observation) -> tuple[int, str]:
        """The chunk ITL may not cut under now (0: none), and why: the larger of a cut that put TTFT
        over (for retry_seconds) and twice what keeps prefill up with the prompts arriving: what TTFT's
        move grows a chunk to when prompts wait, so a cut below it would be grown straight back."""
        keep_up = int(KEEP_UP_MARGIN * keep_up_tokens(observation))
        remembered = self._chunk_floor[0] if self._chunk_floor is not None and observation.time < self._chunk_floor[1] else 0
        if remembered >= keep_up and remembered:
            return remembered, f"a chunk under it put TTFT over, {self._chunk_floor[1] - observation.time:.0f} s more"
        return keep_up, f"{KEEP_UP_MARGIN:g} × the {keep_up / KEEP_UP_MARGIN:.0f} prompt tokens a worker's step must prefill to keep up" if keep_up else ""

    def _batches_full(self, observation: Observation, knobs: Knobs) -> bool:
        ready = ready_workers(observation)
        held = sum(w.load for w in ready) / len(ready) if ready else 0.0
        return held >= self.params.fill_threshold * knobs.max_batch_size

    def _fewer_sequences(self, knobs: Knobs, bounds: Bounds) -> Knobs:
        smaller = min(knobs.max_batch_size - 1, int(knobs.max_batch_size * self.params.decrease_factor))
        return knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", smaller))

    @staticmethod
    def _layout(knobs: Knobs, bounds: Bounds, processes: int) -> Knobs:
        """`processes` workers (within bounds), the most threads the bounds allow spread over them."""
        processes = clamp_knob(bounds, "process_count", processes)
        threads = clamp_knob(bounds, "threads_per_process", bounds.threads_per_process[1] // processes)
        return knobs.replace(process_count=processes, threads_per_process=threads)

