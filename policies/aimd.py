"""Additive-increase / multiplicative-decrease of `max_batch_size` against a p99 latency SLO.

Clipper's batch-size controller (Crankshaw et al., NSDI 2017), fed with the sampler's window:

- not enough requests finished in the window (fewer than `min_requests` at `stage`): hold;
- p99 > SLO: max_batch_size × decrease_factor (down by at least 1), never below the items one
  request brings each worker (Clipper's requests are one item each; a request of many is as late
  as its last batch, and smaller batches only split it further); optionally halve
  batch_timeout too, so a partly filled batch does not wait while latency is already over.
  With `model_budget_fraction` set, only when the batch itself is what is slow (model-stage
  p99 > that share of the SLO), and then at least in proportion to the overshoot (size ×
  share × SLO / model p99), so a batch far too slow is cut at once. Otherwise the time goes
  to queueing, the workers lack throughput, and a smaller batch would only lower it further (Clipper's rule assumes the
  batch time dominates): then full batches grow (by `additive_step`, or × `queueing_growth_factor`
  when that is more), and partly full ones hold;
- p99 within the SLO and batches full enough that the size limit binds (mean batch size
  >= fill_threshold × max_batch_size): max_batch_size + additive_step;
  with requests of many items, both moves go in whole multiples of a request's items per worker;
- otherwise hold: a larger limit would not make the batches any larger.
With `min_efficiency_gain`, a growth that did not raise the items per model-second by that
share (judged at the next decision after the cooldown, under the same process × thread layout,
whether or not the latency then meets the SLO, and only if the batches then ran larger than the
old size) is undone and its size becomes a ceiling for
`ceiling_seconds` (inputs of mixed lengths pad to the longest, so past some size a larger batch
is slower per item; long inputs gain nothing from batching at all).

After every change the policy waits `cooldown_seconds` (by default one sampler window), so the
next decision reads latencies measured under the new batch size, not the old one.
Only max_batch_size (and, if asked, batch_timeout) changes.
"""

from __future__ import annotations

import math

from pydantic import Field

from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import Decision, Params, clamp_knob, describe_changes


class AimdParams(Params):
    slo_p99_seconds: float = Field(gt=0)
    """The latency objective: p99 of `stage`, in seconds."""
    stage: str = "total"
    """Which latency stage the SLO applies to (total, queue, model, ...; ttft for generation)."""
    additive_step: int = Field(2, ge=1)
    """Items added to max_batch_size when the limit binds and latency is fine."""
    decrease_factor: float = Field(0.75, gt=0, lt=1)
    """max_batch_size is multiplied by this when p99 is over the SLO (and lowered by at least 1)."""
    fill_threshold: float = Field(0.8, gt=0, le=1)
    """The size limit binds when the mean batch size >= fill_threshold × max_batch_size."""
    min_requests: int = Field(20, ge=0)
    """Requests that must have finished at `stage` in the window before the policy acts."""
    cooldown_seconds: float = Field(10.0, ge=0)
    """Seconds to hold after a change, so the window reflects the new setting (one sampler window)."""
    halve_timeout_over_slo: bool = False
    """Also halve batch_timeout when p99 is over the SLO."""
    increase_below: float = Field(1.0, gt=0, le=1)
    """Grow only while p99 <= increase_below × SLO. 1.0 is Clipper's rule (grow up to the SLO,
    so the sawtooth's peaks touch it); below 1 keeps the peaks under the SLO."""
    model_budget_fraction: float | None = Field(None, gt=0, le=1)
    """Over the SLO, shrink only when the model stage's p99 exceeds this share of the SLO; when
    queueing is what breaks it, grow full batches instead. None: always shrink (Clipper)."""
    queueing_growth_factor: float = Field(1.0, ge=1)
    """When queueing breaks the SLO and batches are full, grow to max(size + additive_step,
    size × this): a backlog wants throughput now, not one step per cooldown (TCP's slow start)."""
    min_efficiency_gain: float | None = Field(None, ge=0)
    """Grow only while it pays: after a growth, if the items per model-second (mean batch size /
    mean batch time, both over batches) did not rise by this share, go back to the previous size
    and stay at or below it for `ceiling_seconds`. Padding makes larger batches of mixed-length inputs slower
    per item past some size. None: always grow (Clipper)."""
    ceiling_seconds: float = Field(120.0, gt=0)
    """How long a size where growing did not pay stays the ceiling (then it is tried again)."""
    saturated_busy: float | None = Field(None, gt=0, le=1)
    """Within the SLO, full batches grow by `queueing_growth_factor` (not `additive_step`) while the
    workers' busy fraction is at least this: saturated workers are about to queue, and a larger batch
    is the throughput they can still find; waiting for the p99 to break first loses the requests that
    break it. None: within the SLO, always the additive step (Clipper)."""
    shrink_below_busy: float | None = Field(None, gt=0, le=1)
    """Over the SLO, shrink only while the workers' busy fraction is below this: a smaller batch
    costs throughput, which saturated workers cannot give (their queue would grow instead).
    None: shrink at any load (Clipper)."""


class AimdPolicy:
    """Clipper-style AIMD on max_batch_size against a p99 SLO."""

    kind = "aimd"

    def __init__(self, params: AimdParams):
        self.params = params
        self.name = self.kind
        self._last_change: float | None = None
        self._grown_from: tuple[int, float, tuple[int, int], float] | None = None
        """(size, items per model-second there, (process_count, threads_per_process), when)
        before the last growth, to judge whether it paid: only under the same layout, and only
        at the next decision after the cooldown (later, the load it was measured at is gone)."""
        self._ceiling: tuple[int, float] | None = None
        """(size, until when): a size above which growing did not pay, for a while."""

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        p = self.params
        now, size = observation.time, knobs.max_batch_size
        if self._last_change is not None and now - self._last_change < p.cooldown_seconds:
            waited = now - self._last_change
            return Decision(knobs, f"cooling down ({waited:.0f} of {p.cooldown_seconds:g} s since the last change): max_batch_size stays {size}")
        latency = observation.load.latency.get(p.stage)
        count = latency.count if latency else 0
        if latency is None or latency.p99 is None or count < p.min_requests:
            return Decision(knobs, f"{count} {p.stage} latencies in the window (< {p.min_requests}): max_batch_size stays {size}")
        failed = self._judge_growth(observation, knobs)
        if failed is not None:
            back, why = knobs.replace(max_batch_size=failed[0]), failed[1]
            if latency.p99 > p.slo_p99_seconds and self._queueing_why(observation) is None:
                back = back.replace(max_batch_size=min(failed[0], self._decrease(observation, knobs, bounds).max_batch_size))
            self._last_change = now
            return Decision(back, f"{why}: {describe_changes(knobs, back)}")

        if latency.p99 > p.slo_p99_seconds:
            why = f"{p.stage} p99 {latency.p99:.3f} s > SLO {p.slo_p99_seconds:.3f} s"
            queueing = self._queueing_why(observation)
            busy = observation.busy_fraction
            if queueing is None and p.shrink_below_busy is not None and busy >= p.shrink_below_busy:
                return Decision(knobs, f"{why}, but workers busy {busy:.2f} >= {p.shrink_below_busy:g}: a smaller batch would lose "
                                       f"throughput they do not have; max_batch_size stays {size}")
            if queueing is None:
                proposal = self._decrease(observation, knobs, bounds)
                share = _request_share(observation, knobs)
                if proposal == knobs:
                    why += f": a request brings each worker {share} items, smaller batches would only split it" if share >= size else ": at the bound"
            elif observation.load.batch_size >= p.fill_threshold * size:
                why = f"{why}, {queueing}, batches full ({observation.load.batch_size:.1f} >= {p.fill_threshold:.2f} × {size})"
                proposal, why = self._grow(observation, knobs, bounds, why, factor=p.queueing_growth_factor)
            else:
                return Decision(knobs, f"{why}, {queueing}, batches not full: max_batch_size stays {size}")
        elif latency.p99 > p.increase_below * p.slo_p99_seconds:
            return Decision(
                knobs,
                f"{p.stage} p99 {latency.p99:.3f} s within the SLO but above {p.increase_below:g} × SLO: max_batch_size stays {size}",
            )
        elif observation.load.batch_size >= p.fill_threshold * size:
            why = (
                f"{p.stage} p99 {latency.p99:.3f} s <= SLO {p.slo_p99_seconds:.3f} s and batches full "
                f"({observation.load.batch_size:.1f} >= {p.fill_threshold:.2f} × {size})"
            )
            factor = 1.0
            if p.saturated_busy is not None and observation.busy_fraction >= p.saturated_busy:
                why, factor = f"{why}, workers busy {observation.busy_fraction:.2f} >= {p.saturated_busy:g}", p.queueing_growth_factor
            proposal, why = self._grow(observation, knobs, bounds, why, factor=factor)
        else:
            return Decision(
                knobs,
                f"{p.stage} p99 {latency.p99:.3f} s <= SLO {p.slo_p99_seconds:.3f} s, batches not full "
                f"({observation.load.batch_size:.1f} < {p.fill_threshold:.2f} × {size}): max_batch_size stays {size}",
            )
        changes = describe_changes(knobs, proposal)
        if not changes:
            return Decision(knobs, f"{why}: max_batch_size stays {size}")
        self._last_change = now
        return Decision(proposal, f"{why}: {changes}")

    def _grow(self, observation: Observation, knobs: Knobs, bounds: Bounds, why: str, factor: float = 1.0) -> tuple[Knobs, str]:
        """max_batch_size + additive_step (or × factor when that is more), not past a ceiling
        where growing did not pay (see min_efficiency_gain); records where it grew from."""
        p = self.params
        size = knobs.max_batch_size
        grown = max(size + p.additive_step, math.ceil(size * factor))
        share = _request_share(observation, knobs)
        if share > 1:
            # Requests of many items: a size between multiples of a request's share per worker only
            # cuts requests across batches (32-text requests at 18 ran batches of 18 and 14, no
            # faster per item than 16, so the growth was judged not to pay and 32 was never tried).
            grown = math.ceil(grown / share) * share
        bigger = knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", grown))
        if bigger.max_batch_size == size:
            return knobs, f"{why}: at the bound"
        if p.min_efficiency_gain is None:
            return bigger, why
        if self._ceiling is not None and observation.time < self._ceiling[1] and bigger.max_batch_size > self._ceiling[0]:
            return knobs, f"{why}, but {self._ceiling[0]} is the ceiling for {self._ceiling[1] - observation.time:.0f} s more (larger batches did not pay)"
        efficiency = _efficiency(observation)
        if efficiency is None:
            return bigger, why
        self._grown_from = (size, efficiency, (knobs.process_count, knobs.threads_per_process), observation.time)
        return bigger, f"{why} ({efficiency:.0f} items per model-second)"

    def _judge_growth(self, observation: Observation, knobs: Knobs) -> tuple[int, str] | None:
        """(the size before it, why) when the last growth, judged now, did not raise the items
        per model-second by min_efficiency_gain; that size becomes the ceiling for a while.
        Judged once, at the first decision after the growth's cooldown, whichever way the
        latency went: a growth that broke the SLO and did not pay either is not retried at once
        (when only growths that met the SLO were judged, 420-token inputs, which gain nothing
        from batching, went 1 → 3 → 1 every ~25 s, over the SLO each time)."""
        p = self.params
        grown_from, self._grown_from = self._grown_from, None
        efficiency = _efficiency(observation)
        if p.min_efficiency_gain is None or grown_from is None or efficiency is None:
            return None
        before, before_efficiency, layout, when = grown_from
        now, size = observation.time, knobs.max_batch_size
        if layout != (knobs.process_count, knobs.threads_per_process) or now - when > 2 * max(p.cooldown_seconds, 1.0):
            return None  # the workers or the load changed since: per-item times are not comparable
        if observation.load.batch_size <= before:
            return None  # the batches never outgrew the old size: the growth is untried, not failed
        if before >= size or efficiency >= before_efficiency * (1 + p.min_efficiency_gain):
            return None
        self._ceiling = (before, now + p.ceiling_seconds)
        return before, (f"{efficiency:.0f} items per model-second at {size} vs {before_efficiency:.0f} at {before}: growing did not "
                        f"pay (< +{p.min_efficiency_gain:.0%}); back, and no higher for {p.ceiling_seconds:g} s")

    def _queueing_why(self, observation: Observation) -> str | None:
        """Why the time over the SLO is queueing rather than batch time; None when it is not."""
        share = self.params.model_budget_fraction
        if share is None:
            return None
        model = observation.load.latency.get("model")
        if model is None or model.p99 is None or model.p99 > share * self.params.slo_p99_seconds:
            return None
        return f"model p99 {model.p99:.3f} s <= {share:g} × SLO (queueing)"

    def _decrease(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Knobs:
        p = self.params
        size = knobs.max_batch_size
        smaller = math.floor(size * p.decrease_factor)  # < size for any factor < 1: always down by >= 1
        model = observation.load.latency.get("model")
        if p.model_budget_fraction is not None and model is not None and model.p99:
            # the batch alone overshoots its share of the SLO: shrink in proportion, at once
            smaller = min(smaller, math.floor(size * p.model_budget_fraction * p.slo_p99_seconds / model.p99))
        # A request's latency is that of its last item: with k items a request, batches smaller than
        # its share per worker only split it into more batches, each paying the per-batch cost
        # (32-text requests shrunk to batches of 4 ran 8 batches each, at 1.5 s p99 and half the cores idle).
        share = _request_share(observation, knobs)
        smaller = max(smaller, min(size, share))
        if share > 1 and smaller > share:
            smaller = smaller // share * share  # whole shares, as growth steps (see _grow)
        proposal = knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", smaller))
        if p.halve_timeout_over_slo:
            proposal = proposal.replace(batch_timeout=clamp_knob(bounds, "batch_timeout", knobs.batch_timeout / 2))
        return proposal


def _request_share(observation: Observation, knobs: Knobs) -> int:
    """Items one request brings each worker: items dispatched per request completed, over the workers."""
    load = observation.load
    if load.items_rate <= 0 or load.completion_rate <= 0:
        return 1
    return max(1, math.floor(load.items_rate / load.completion_rate / knobs.process_count))


def _efficiency(observation: Observation) -> float | None:
    """Items per second of worker time over the window (mean batch size / mean batch time)."""
    load = observation.load
    if load.batch_size <= 0 or load.batch_seconds <= 0:
        return None
    return load.batch_size / load.batch_seconds
