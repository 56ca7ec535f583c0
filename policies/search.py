"""Online hill-climbing over the knobs on measured goodput.

Goodput of one observation:

    goodput = completion_rate                        if p99 <= SLO
              completion_rate × SLO / p99            otherwise

The penalty is smooth on purpose. A hard cut (goodput 0 over the SLO) makes every setting
that misses the SLO look the same, so a search that starts there has no direction to climb;
scaling by SLO / p99 keeps "how far over" in the number and is continuous at p99 = SLO.
Below saturation every setting that meets the SLO completes what arrives, so all score alike
and the search settles where it is: it spends no trials where there is nothing to gain.

The state machine (`state`):

    BASELINE  measure the incumbent: ignore `settle_seconds` after the last change (the
              sampler's window must refill), then average goodput over `trial_seconds`.
    TRIAL     the same for one neighbour of the best (one knob, one step: process_count ±1,
              threads_per_process ±1, io_threads ±1, max_batch_size ×2 / ÷2, batch_timeout
              ×2 / ÷2 from a floor of `timeout_floor` when 0). Kept when its goodput beats the
              best by more than `min_improvement`; otherwise the next neighbour of the best is
              tried (rolling the trial back in the same step) or, when none is left, the best is
              restored and the search holds. Neighbours are tried in one fixed order (a shuffle
              seeded by `seed`), neighbours outside bounds and settings already measured in this
              round are skipped.
    HOLD      keep the best; go back to BASELINE when the arrival rate differs from the rate
              at which the best was found by more than `reexplore_load_change` (relative).

A load change of that size during a measurement also restarts from BASELINE, since goodputs
measured at different loads do not compare. When the controller applies a trial differently
(a pinned knob, a hardware limit), what it applied is measured as the trial, or skipped when
that is the best or was measured already; knobs changed outside the search at any other time
(an operator's change) become the new incumbent, measured from BASELINE.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from engine.config import Bounds, Knobs
from monitors.observation import Observation
from policies.base import KNOB_NAMES, Decision, KnobName, Params, describe_changes, in_bounds

State = Literal["baseline", "trial", "hold"]


class SearchParams(Params):
    slo_p99_seconds: float = Field(gt=0)
    """The p99 latency objective (of `stage`) in seconds; goodput is penalised above it."""
    stage: str = "total"
    """Latency stage the SLO applies to."""
    knobs: list[KnobName] = Field(default_factory=lambda: list(KNOB_NAMES[:5]), min_length=1)
    """Knobs the search may move (in a composite: exactly the ones this member owns); by
    default the five every task has (the generation knobs only when named)."""
    settle_seconds: float = Field(10.0, ge=0)
    """Seconds ignored after a change: at least the sampler's window, so no old data is counted."""
    trial_seconds: float = Field(20.0, gt=0)
    """Seconds of observations averaged into one measurement."""
    min_improvement: float = Field(0.03, ge=0)
    """A trial is kept only if its goodput > best × (1 + min_improvement); guards against noise."""
    reexplore_load_change: float = Field(0.3, gt=0)
    """Relative change of the arrival rate (vs. when the best was found) that restarts the search."""
    timeout_floor: float = Field(0.001, gt=0)
    """batch_timeout ×2 starts from here when it is 0; ÷2 below it goes to 0."""
    seed: int = 0
    """Seeds the one shuffle of the neighbour order (same seed, same order)."""


@dataclass(frozen=True, slots=True)
class Move:
    knob: str
    step: str  # "+1", "-1", "x2", "/2"

    def apply(self, knobs: Knobs, timeout_floor: float) -> Knobs:
        value = getattr(knobs, self.knob)
        if self.knob == "batch_timeout":
            value = _double_timeout(value, timeout_floor) if self.step == "x2" else _halve_timeout(value, timeout_floor)
        elif self.step == "x2":
            value = value * 2
        elif self.step == "/2":
            value = max(1, value // 2)
        else:
            value = value + (1 if self.step == "+1" else -1)
        return knobs.replace(**{self.knob: value})


def _double_timeout(value: float, floor: float) -> float:
    return floor if value < floor else value * 2


def _halve_timeout(value: float, floor: float) -> float:
    return 0.0 if value / 2 < floor else value / 2


_STEPS = {
    "process_count": ("+1", "-1"),
    "threads_per_process": ("+1", "-1"),
    "io_threads": ("+1", "-1"),
    "max_batch_size": ("x2", "/2"),
    "batch_timeout": ("x2", "/2"),
    "max_batch_tokens": ("x2", "/2"),
    "kv_tokens": ("x2", "/2"),
}


def goodput(observation: Observation, slo: float, stage: str) -> float:
    """completion_rate, scaled by SLO / p99 when p99 is over the SLO (see the module docstring)."""
    load = observation.load
    latency = load.latency.get(stage)
    if latency is None or latency.p99 is None or latency.p99 <= slo:
        return load.completion_rate
    return load.completion_rate * slo / latency.p99


class Measurement:
    """Mean goodput and arrival rate over `trial_seconds`, after `settle_seconds` from `since`."""

    def __init__(self, since: float, settle: float, duration: float):
        self.start = since + settle
        self.duration = duration
        self.goodputs: list[float] = []
        self.arrivals: list[float] = []
        self.first: float | None = None
        self.last: float | None = None

    def add(self, time: float, goodput_value: float, arrival: float) -> None:
        if time < self.start:
            return
        if self.first is None:
            self.first = time
        self.last = time
        self.goodputs.append(goodput_value)
        self.arrivals.append(arrival)

    @property
    def done(self) -> bool:
        return self.first is not None and self.last - self.first >= self.duration

    @property
    def goodput(self) -> float:
        return sum(self.goodputs) / len(self.goodputs)

    @property
    def arrival(self) -> float:
        return sum(self.arrivals) / len(self.arrivals)


class SearchPolicy:
    """Hill-climbing over the knobs on goodput; BASELINE -> TRIAL ... -> HOLD, re-explores on load change."""

    kind = "search"

    def __init__(self, params: SearchParams):
        self.params = params
        self.name = self.kind
        moves = [Move(k, s) for k in KNOB_NAMES if k in params.knobs for s in _STEPS[k]]
        random.Random(params.seed).shuffle(moves)
        self.moves: tuple[Move, ...] = tuple(moves)
        self.state: State = "baseline"
        self.best: Knobs | None = None
        self.best_goodput = 0.0
        self.best_arrival = 0.0
        self._proposed: Knobs | None = None
        self._trial: Knobs | None = None
        self._measuring: Measurement | None = None
        self._tried: set[Knobs] = set()

    def decide(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        now = observation.time
        if self._proposed is not None and knobs != self._proposed and self.state == "trial":
            return self._trial_adjusted(knobs, now, bounds)
        if self._proposed is None or knobs != self._proposed:
            note = "starting" if self._proposed is None else "knobs changed outside the search"
            self._start_baseline(knobs, now)
            return self._propose(knobs, f"{note}: measuring {_short(knobs)} as the baseline")
        if self.state == "hold":
            return self._hold(observation, knobs)
        return self._measure(observation, knobs, bounds)

    # -- states --------------------------------------------------------------------------------

    def _hold(self, observation: Observation, knobs: Knobs) -> Decision:
        arrival = observation.load.arrival_rate
        if self._load_changed(arrival):
            self._tried.clear()
            self._start_baseline(knobs, observation.time, settle=False)
            return self._propose(knobs, f"arrival {arrival:.1f}/s vs {self.best_arrival:.1f}/s when the best was found: re-exploring")
        return self._propose(knobs, f"holding the best ({self.best_goodput:.1f}/s goodput at {self.best_arrival:.1f}/s arrivals)")

    def _measure(self, observation: Observation, knobs: Knobs, bounds: Bounds) -> Decision:
        p = self.params
        self._measuring.add(observation.time, goodput(observation, p.slo_p99_seconds, p.stage), observation.load.arrival_rate)
        if self.state == "trial" and self._load_changed(observation.load.arrival_rate):
            self._tried.clear()
            self._start_baseline(self.best, observation.time)
            return self._propose(self.best, f"arrival {observation.load.arrival_rate:.1f}/s moved during the trial: back to {_short(self.best)}, re-measuring")
        if not self._measuring.done:
            return self._propose(knobs, f"{self.state}: measuring {_short(knobs)}")
        measured = self._measuring.goodput
        if self.state == "baseline":
            self.best, self.best_goodput, self.best_arrival = knobs, measured, self._measuring.arrival
            return self._next_trial(observation.time, bounds, f"baseline goodput {measured:.1f}/s")
        return self._judge_trial(observation.time, measured, bounds)

    def _judge_trial(self, now: float, measured: float, bounds: Bounds) -> Decision:
        trial, p = self._trial, self.params
        if measured > self.best_goodput * (1 + p.min_improvement):
            text = f"trial {describe_changes(self.best, trial)} raised goodput {self.best_goodput:.1f} -> {measured:.1f}/s: kept"
            self.best, self.best_goodput, self.best_arrival = trial, measured, self._measuring.arrival
            return self._next_trial(now, bounds, text)
        text = (
            f"trial {describe_changes(self.best, trial)} goodput {measured:.1f}/s not above "
            f"{self.best_goodput:.1f}/s × {1 + p.min_improvement:.2f}: rolled back"
        )
        return self._next_trial(now, bounds, text)

    def _next_trial(self, now: float, bounds: Bounds, text: str) -> Decision:
        candidate = self._next_neighbour(bounds)
        if candidate is None:
            self.state, self._trial, self._measuring = "hold", None, None
            return self._propose(self.best, f"{text}; no neighbour of {_short(self.best)} improves: holding")
        self.state, self._trial = "trial", candidate
        self._tried.add(candidate)
        self._measuring = Measurement(now, self.params.settle_seconds, self.params.trial_seconds)
        return self._propose(candidate, f"{text}; next trial: {describe_changes(self.best, candidate)}")

    def _trial_adjusted(self, knobs: Knobs, now: float, bounds: Bounds) -> Decision:
        """The controller changed the trial (a pinned knob, a hardware limit): judge what it applied."""
        proposed = self._proposed
        if knobs == self.best or knobs in self._tried:
            self._tried.add(knobs)
            return self._next_trial(now, bounds, f"trial {_short(proposed)} was applied as {_short(knobs)}, already measured: skipped")
        self._tried.add(knobs)
        self._trial = knobs
        self._measuring = Measurement(now, self.params.settle_seconds, self.params.trial_seconds)
        return self._propose(knobs, f"trial {_short(proposed)} was applied as {_short(knobs)}: measuring that as the trial")

    # -- helpers -------------------------------------------------------------------------------

    def _next_neighbour(self, bounds: Bounds) -> Knobs | None:
        for move in self.moves:
            candidate = move.apply(self.best, self.params.timeout_floor)
            value = getattr(candidate, move.knob)
            if candidate == self.best or candidate in self._tried or not in_bounds(bounds, move.knob, value):
                continue
            return candidate
        return None

    def _start_baseline(self, knobs: Knobs, now: float, settle: bool = True) -> None:
        self.state, self.best, self._trial = "baseline", knobs, None
        self._tried.add(knobs)
        self._measuring = Measurement(now, self.params.settle_seconds if settle else 0.0, self.params.trial_seconds)

    def _load_changed(self, arrival: float) -> bool:
        reference = self.best_arrival
        if reference <= 0:
            return arrival > 0 and self.state == "hold"
        return abs(arrival / reference - 1) > self.params.reexplore_load_change

    def _propose(self, knobs: Knobs, reason: str) -> Decision:
        self._proposed = knobs
        return Decision(knobs, reason)


def _short(knobs: Knobs) -> str:
    return (
        f"{knobs.process_count}p×{knobs.threads_per_process}t io={knobs.io_threads} "
        f"B={knobs.max_batch_size} wait={knobs.batch_timeout * 1000:g}ms"
    )
