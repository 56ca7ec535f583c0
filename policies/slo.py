"""SLO-driven adaptive batching (BentoML style): a fitted batch-latency model sets batch size and wait.

Online model of one batch's time in the model, fitted by exponentially weighted least squares
over the finished batches themselves (each observation's window adds its batches' sums,
load.batch_times; older sums fade by `forgetting_factor` per observation):

    service(B) ≈ a + b × B        B = items in a batch, service = its worker time

Fitting batches, not the window's mean size against its mean time: sizes vary from batch to
batch (1, 3, 2, 1, ...) even when their mean over a window hardly moves, and a steady load,
say long inputs that never fill a batch, keeps the mean still for good, so a fit on means never
learns the slope and the wait it would set stays what it was. Per batch, not per request: the
per-request model latency weighs each batch by its items, so a window of many single-item
batches and a few full ones pairs a small B with the full batches' time, and the fitted
intercept (which caps the wait, below) comes out far above a batch's fixed cost.

The Observation carries no token counts per item, so x is items per batch, not tokens per batch:
the fit is right for a stable input-length mix and drifts (through forgetting) when it changes.

With the fit, the item arrival rate λ and the current process_count P, each decision picks:

    (i)  capacity:  P × B / service(B) >= λ × (1 + headroom)       smallest such B
    (ii) latency:   batch_timeout + service(B) <= slo_p99_seconds × budget_fraction
    batch_timeout = min(time for the shared batcher to gather B items at λ, a, what (ii) leaves)

Why never longer than a, the fixed cost of a batch: the wait only matters while a worker is
idle (a busy engine's queue fills batches by itself, and the batcher closes a full batch at
once), and what a fuller batch saves over sending what is there and the rest next is one
batch's fixed cost. Waiting longer than that spends more of the waiting items' latency than it
can ever save.

The rest of the SLO (1 - budget_fraction) is left for queueing. When no B up to the bound
meets (i), the policy takes the largest B whose service still fits the budget (most throughput
the SLO allows) and says that capacity is short: adding workers is another policy's job.
Until the fit has `min_points` observations, batch sizes that vary (standard deviation at least
`min_batch_size_std`) and a positive slope, it holds, with one exception: when nearly every
batch of the window held a single item, the wait gathers nothing at this rate and goes to 0.
Only max_batch_size and batch_timeout change (max_batch_size only when `tune_batch_size`);
process and thread counts are left to other policies: put this one in a composite next to a
threshold policy for process_count.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from engine.config import Bounds, Knobs
from monitors.observation import BatchTimes, Load, Observation
from policies.base import Decision, Params, clamp_knob, describe_changes

_MIN_SERVICE_SECONDS = 1e-6
SINGLE_ITEM_MEAN = 1.05
"""Batches this close to one item on average: the wait gathers nothing (see _single_item_batches)."""


class SloParams(Params):
    slo_p99_seconds: float = Field(gt=0)
    """The end-to-end p99 latency objective, in seconds."""
    budget_fraction: float = Field(0.5, gt=0, le=1)
    """Share of the SLO that batch_timeout + one batch's service may take; the rest is for queueing."""
    headroom: float = Field(0.2, ge=0)
    """Capacity kept above the arrival rate: 0.2 sizes for 1.2 × the observed rate."""
    forgetting_factor: float = Field(0.98, gt=0, le=1)
    """Weight kept by past observations' batches at each new observation (1 = never forget;
    0.98 ≈ the last 50 observations)."""
    min_points: int = Field(2, ge=2)
    """Observations fitted before the policy acts (each brings its window's batches)."""
    min_batch_size_std: float = Field(0.5, ge=0)
    """The fitted batches' sizes must have at least this standard deviation (items), else b is unknown."""
    min_requests: int = Field(5, ge=1)
    """An observation is fitted only when at least this many model latencies are in its window."""
    tune_batch_size: bool = True
    """Set max_batch_size to the chosen B; when false, max_batch_size is left to another policy
    and only batch_timeout is set (for the smallest B that meets capacity, at most the current limit)."""


class BatchTimeFit:
    """service ≈ a + b·size by least squares over batches, older windows' sums fading."""

    def __init__(self, forgetting_factor: float):
        self.forgetting_factor = forgetting_factor
        self.sums = np.zeros(5)
        """Σ1, Σx, Σx², Σy, Σxy over the batches fitted, each weighted by its fading."""
        self.points = 0
        """Observations fitted."""

    def update(self, times: BatchTimes) -> None:
        window = (times.batches, times.items, times.items_squared, times.seconds, times.item_seconds)
        self.sums = self.sums * self.forgetting_factor + np.array(window, dtype=np.float64)
        self.points += 1

    @property
    def size_std(self) -> float:
        """Standard deviation of the fitted batches' sizes."""
        n, sx, sxx = self.sums[:3]
        return float(np.sqrt(max(0.0, sxx / n - (sx / n) ** 2))) if n > 0 else 0.0

    @property
    def slope(self) -> float:
        n, sx, sxx, sy, sxy = self.sums
        variance = n * sxx - sx * sx
        return float((n * sxy - sx * sy) / variance) if n > 0 and variance > 1e-12 * max(1.0, n * sxx) else 0.0

    @property
    def intercept(self) -> float:
        n, sx, _, sy, _ = self.sums
        return float((sy - self.slope * sx) / n) if n > 0 else 0.0

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


class SloPolicy:
    """Adaptive batch size and timeout from a fitted batch-latency model and the arrival rate."""

    kind = "slo"

    def __init__(self, params: SloParams):
        self.params = params
        self.name = self.kind
        self.fit = BatchTimeFit(params.forgetting_factor)
        self._last_fitted_time: float | None = None

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        p = self.params
        self._learn(observation)
        single = self._single_item_batches(observation)
        if single is not None:
            return _decision(knobs, knobs.replace(batch_timeout=clamp_knob(bounds, "batch_timeout", 0.0)), single)
        if self.fit.points < p.min_points or self.fit.size_std < p.min_batch_size_std or self.fit.slope <= 0:
            return Decision(
                knobs,
                f"fitting batch latency ({self.fit.points} of {p.min_points} observations, batch sizes' std "
                f"{self.fit.size_std:.2f} of {p.min_batch_size_std:g}, slope {self.fit.slope * 1000:.3f} ms per item): holding",
            )
        demand = item_demand(observation.load)
        if demand <= 0:
            return Decision(knobs, f"no traffic ({self._fit_text()}): holding")

        size, capacity_note = self._choose_batch_size(demand, knobs, bounds)
        timeout = self._choose_timeout(size, demand, bounds)
        proposal = knobs.replace(batch_timeout=timeout)
        if p.tune_batch_size:
            proposal = proposal.replace(max_batch_size=size)
        service = self._service(size)
        why = (
            f"{self._fit_text()}; {demand:.0f} items/s on {knobs.process_count} workers: B={size} "
            f"(service {service * 1000:.1f} ms{capacity_note}), wait {timeout * 1000:.1f} ms"
        )
        return _decision(knobs, proposal, why)

    def _single_item_batches(self, observation: Observation) -> str | None:
        """Why no wait is worth it when nearly every batch in the window held one item although
        the batcher waited `batch_timeout` for more: the wait gathers nothing at this rate (and
        the sizes do not vary, so the fit cannot tell). None otherwise."""
        times = observation.load.batch_times
        if self.fit.points < self.params.min_points or times.batches < self.params.min_requests:
            return None
        mean = times.items / times.batches
        if mean > SINGLE_ITEM_MEAN:
            return None
        return f"{times.batches} batches of {mean:.2f} items on average in the window: waiting gathers nothing, wait 0"

    def _learn(self, observation: Observation) -> None:
        """Fit the batches of each new observation that has batches and model latencies in its window."""
        load = observation.load
        model = load.latency.get("model")
        if self._last_fitted_time is not None and observation.time <= self._last_fitted_time:
            return
        if model is None or model.count < self.params.min_requests or load.batch_times.batches <= 0 or load.batch_times.seconds <= 0:
            return
        self.fit.update(load.batch_times)
        self._last_fitted_time = observation.time

    def _service(self, size: int) -> float:
        return max(self.fit.predict(size), _MIN_SERVICE_SECONDS)

    def _latency_budget(self) -> float:
        return self.params.slo_p99_seconds * self.params.budget_fraction

    def _choose_batch_size(self, demand: float, knobs: Knobs, bounds: Bounds) -> tuple[int, str]:
        """Smallest B whose capacity covers demand × (1 + headroom); see the module docstring."""
        lo, hi = bounds.max_batch_size
        if not self.params.tune_batch_size:
            hi = clamp_knob(bounds, "max_batch_size", knobs.max_batch_size)
        needed = demand * (1 + self.params.headroom)
        for size in range(lo, hi + 1):
            if knobs.process_count * size / self._service(size) >= needed:
                return size, ""
        within_budget = [s for s in range(lo, hi + 1) if self._service(s) <= self._latency_budget()]
        size = max(within_budget) if within_budget else lo
        capacity = knobs.process_count * size / self._service(size)
        return size, f"; capacity short: {capacity:.0f} < {needed:.0f} items/s"

    def _choose_timeout(self, size: int, demand: float, bounds: Bounds) -> float:
        fill = (size - 1) / demand  # the batcher is shared: the first item is there, B - 1 more to come
        allowed = max(0.0, self._latency_budget() - self._service(size))
        fixed_cost = max(0.0, self.fit.intercept)
        return clamp_knob(bounds, "batch_timeout", min(fill, fixed_cost, allowed))

    def _fit_text(self) -> str:
        return f"model ≈ {self.fit.intercept * 1000:.2f} ms + {self.fit.slope * 1000:.3f} ms × B"


def _decision(knobs: Knobs, proposal: Knobs, why: str) -> Decision:
    changes = describe_changes(knobs, proposal)
    return Decision(proposal, f"{why}: {changes}" if changes else f"{why}: no change")


def item_demand(load: Load) -> float:
    """Items per second asked of the engine.

    items_rate counts items dispatched, which stops growing at saturation; arrival_rate counts
    requests. Requests × items per request (items per completed request) estimates demand even
    when the engine falls behind.
    """
    if load.arrival_rate > 0 and load.completion_rate > 0 and load.items_rate > 0:
        return max(load.items_rate, load.arrival_rate * load.items_rate / load.completion_rate)
    return max(load.items_rate, load.arrival_rate)
