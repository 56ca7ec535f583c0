"""Additive-increase / multiplicative-decrease of `max_batch_size` against a p99 latency SLO.

Clipper's batch-size controller (Crankshaw et al., NSDI 2017), fed with the sampler's window:

- not enough requests finished in the window (fewer than `min_requests` at `stage`): hold;
- p99 > SLO: max_batch_size × decrease_factor (down by at least 1); optionally halve
  batch_timeout too, so a partly filled batch does not wait while latency is already over;
- p99 within the SLO and batches full enough that the size limit binds (mean batch size
  >= fill_threshold × max_batch_size): max_batch_size + additive_step;
- otherwise hold: a larger limit would not make the batches any larger.

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


class AimdPolicy:
    """Clipper-style AIMD on max_batch_size against a p99 SLO."""

    kind = "aimd"

    def __init__(self, params: AimdParams):
        self.params = params
        self.name = self.kind
        self._last_change: float | None = None

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

        if latency.p99 > p.slo_p99_seconds:
            proposal = self._decrease(knobs, bounds)
            why = f"{p.stage} p99 {latency.p99:.3f} s > SLO {p.slo_p99_seconds:.3f} s"
        elif latency.p99 > p.increase_below * p.slo_p99_seconds:
            return Decision(
                knobs,
                f"{p.stage} p99 {latency.p99:.3f} s within the SLO but above {p.increase_below:g} × SLO: max_batch_size stays {size}",
            )
        elif observation.load.batch_size >= p.fill_threshold * size:
            proposal = knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", size + p.additive_step))
            why = (
                f"{p.stage} p99 {latency.p99:.3f} s <= SLO {p.slo_p99_seconds:.3f} s and batches full "
                f"({observation.load.batch_size:.1f} >= {p.fill_threshold:.2f} × {size})"
            )
        else:
            return Decision(
                knobs,
                f"{p.stage} p99 {latency.p99:.3f} s <= SLO {p.slo_p99_seconds:.3f} s, batches not full "
                f"({observation.load.batch_size:.1f} < {p.fill_threshold:.2f} × {size}): max_batch_size stays {size}",
            )
        changes = describe_changes(knobs, proposal)
        if not changes:
            return Decision(knobs, f"{why}: at the bound, max_batch_size stays {size}")
        self._last_change = now
        return Decision(proposal, f"{why}: {changes}")

    def _decrease(self, knobs: Knobs, bounds: Bounds) -> Knobs:
        p = self.params
        size = knobs.max_batch_size
        smaller = math.floor(size * p.decrease_factor)  # < size for any factor < 1: always down by >= 1
        proposal = knobs.replace(max_batch_size=clamp_knob(bounds, "max_batch_size", smaller))
        if p.halve_timeout_over_slo:
            proposal = proposal.replace(batch_timeout=clamp_knob(bounds, "batch_timeout", knobs.batch_timeout / 2))
        return proposal
