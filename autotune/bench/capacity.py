"""Max QPS within an SLO: an ascending ladder of open-loop rates, then bisection.

`RateLadder` is pure logic (results in, next rate out), so the search is testable without a
server. `measure_step` runs one rate against a server and judges it: Poisson arrivals for
`seconds` (as many as the rate makes, in the settling part and in the judged part), the first
`settle` share of the step not judged (an autotuned server gets the same time to react that a
static one does not need), and the step passes when the p99 latency of the judged requests is
within the SLO and at least 99 % of them got a 200.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from autotune.bench.loadgen import Result


@dataclass(frozen=True, slots=True)
class LadderConfig:
    start: float
    """First rate offered (requests/s)."""
    factor: float = 1.3
    """Each passing rate is followed by rate × factor, until one fails."""
    refine: int = 2
    """Bisections between the highest pass and the lowest fail."""
    max_steps: int = 14
    min_rate: float = 0.5
    """Below this the search gives up (the server cannot meet the SLO at any useful rate)."""


@dataclass
class RateLadder:
    """Which rate to offer next, from the pass/fail of the rates offered so far."""

    config: LadderConfig
    passed: list[float] = field(default_factory=list)
    failed: list[float] = field(default_factory=list)
    bisections: int = 0

    def record(self, rate: float, ok: bool) -> None:
        if self._bracket() is not None:
            self.bisections += 1
        (self.passed if ok else self.failed).append(rate)

    @property
    def best(self) -> float:
        """The highest rate that passed below the lowest failure (0 when none did)."""
        bracket = self._bracket()
        if bracket is not None:
            return bracket[0]
        return max(self.passed, default=0.0) if not self.failed else 0.0

    def next_rate(self) -> float | None:
        c = self.config
        offered = len(self.passed) + len(self.failed)
        if offered >= c.max_steps:
            return None
        if not self.failed:
            return c.start * c.factor**offered
        bracket = self._bracket()
        if bracket is None:  # even the lowest rate failed: step down (twice as fast) until one passes
            lower = min(self.failed) / c.factor**2
            return lower if lower >= c.min_rate else None
        if self.bisections >= c.refine:
            return None
        return (bracket[0] + bracket[1]) / 2

    def _bracket(self) -> tuple[float, float] | None:
        """(highest pass below the lowest failure, lowest failure), once both exist."""
        if not self.failed:
            return None
        low_fail = min(self.failed)
        high_pass = max((r for r in self.passed if r < low_fail), default=None)
        return None if high_pass is None else (high_pass, low_fail)


@dataclass(frozen=True, slots=True)
class StepResult:
    offered: float
    """Requests per second sent (Poisson)."""
    throughput: float
    """200s finished per second within the judged part of the step (under overload: capacity)."""
    ok_fraction: float
    mean: float
    p50: float
    p99: float
    """Latency of the judged 200s, seconds (from the scheduled send time)."""
    passed: bool
    cpu_cores: float
    """Cores the server used during the step (CPU seconds of all its processes / wall seconds)."""
    lag_p99: float
    """The generator's own p99 delay in sending (it must stay far below the latencies)."""
    stages: dict[str, float]
    """Mean server-reported stage times (seconds) of the judged 200s."""
    batch_items: float = math.nan
    """Mean items per forward pass the judged 200s ran in (from their x-selftune-batch header;
    one text per request, so a batch of k was reported by k requests). NaN when not reported."""

    def as_dict(self) -> dict:
        return asdict(self)


def poisson_arrivals(rate: float, seconds: float, seed: int, judged_from: float = 0.0) -> list[float]:
    """A Poisson process's arrival times over `seconds`, conditioned on rate × seconds of them
    before and after `judged_from` (where a step's judged part starts).

    Given its count, a Poisson process's times are independent uniforms, so a step keeps its
    bursts; fixing the counts keeps the judged part at the rate the step is labelled with. A
    free count is off by ±1/√(rate × seconds): ±30 % over a 10-s judged window at 1 req/s,
    enough to put 2.8 req/s on a step labelled 1.52 and decide a ladder by its draw."""
    rng = np.random.default_rng(seed)
    edges = [0.0, judged_from, seconds] if 0.0 < judged_from < seconds else [0.0, seconds]
    parts = [rng.uniform(a, b, size=int(round(rate * (b - a)))) for a, b in zip(edges, edges[1:])]
    return np.sort(np.concatenate(parts)).tolist()


def judge(results: list[Result], offered: float, judged_from: float, seconds: float, slo: float, cpu_cores: float) -> StepResult:
    """A step's numbers over the requests scheduled at or after `judged_from` seconds."""
    judged = [r for r in results if r.sent_at >= judged_from]
    ok = [r for r in judged if r.status == 200]
    latencies = np.array([r.latency for r in ok]) if ok else np.array([math.inf])
    ok_fraction = len(ok) / len(judged) if judged else 0.0
    p99 = float(np.percentile(latencies, 99))
    stage_names = {k for r in ok for k in r.stages}
    stages = {k: float(np.mean([r.stages[k] for r in ok if k in r.stages])) for k in sorted(stage_names)}
    finished = sum(1 for r in ok if judged_from <= r.sent_at + r.latency <= seconds)
    return StepResult(
        offered=offered,
        throughput=finished / max(1e-9, seconds - judged_from),
        ok_fraction=ok_fraction,
        mean=float(latencies.mean()),
        p50=float(np.percentile(latencies, 50)),
        p99=p99,
        passed=bool(judged) and ok_fraction >= 0.99 and p99 <= slo,
        cpu_cores=cpu_cores,
        lag_p99=float(np.percentile([r.lag for r in results], 99)) if results else 0.0,
        stages=stages,
        batch_items=mean_batch_items(ok),
    )


def mean_batch_items(results: list[Result]) -> float:
    """Items per forward pass, averaged over the passes (not the requests) single-text requests ran in."""
    sizes = [r.batch[0] for r in results if r.batch]
    return len(sizes) / sum(1.0 / k for k in sizes) if sizes else math.nan


def measure_step(
    send: Callable[[list[float], Callable[[int], bytes]], list[Result]],
    rate: float,
    seconds: float,
    settle: float,
    slo: float,
    body: Callable[[int], bytes],
    seed: int,
    cpu_seconds: Callable[[], float] | None = None,
) -> tuple[StepResult, list[Result]]:
    """Offer `rate` req/s for `seconds` through `send(arrivals, body)`; judge the part after `settle` × seconds."""
    arrivals = poisson_arrivals(rate, seconds, seed, settle * seconds)
    cpu0, t0 = (cpu_seconds() if cpu_seconds else 0.0), time.monotonic()
    results = send(arrivals, body)
    wall = time.monotonic() - t0
    cores = (cpu_seconds() - cpu0) / wall if cpu_seconds else math.nan
    return judge(results, rate, settle * seconds, seconds, slo, cores), results
