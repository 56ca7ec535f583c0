"""Discrete-event simulation of the embedding engine on a virtual clock.

It drives THE SAME objects as the live server: `engine.scheduler.Scheduler` (its Batcher and
Router) decides every batch and every worker it goes to, a policy from `policies/` decides the
knobs through the live controller's `DecisionLoop` (interval, cooldown, guardrails). Only the
workers are simulated: a batch takes what the cost model says, given how many workers are busy
when it starts. Nothing here reads a clock; `now` is the time of the event being handled.

The loop (autotune/offline/sim_loop.py, shared with the generation simulator) is `engine.core.EngineCore`'s turn: handle one event (an arrival, a batch done, a
worker ready, a batcher wake-up, a sampler tick), then carry out `Scheduler.reconcile` (start,
drain, stop workers), then dispatch what the scheduler says. Counters are the engine's
`Counters`, counted by the same methods, and the Observation's Load comes from the live
sampler's `LoadWindow`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autotune.offline.costmodel import SPREADS, CostModel, check_percentiles
from autotune.offline.sim_loop import FIRST_EVENT, READY, LoopConfig, SimLoop
from engine import packing
from engine.batcher import Batch
from engine.config import INFLIGHT_BATCHES, Knobs
from engine.scheduler import Scheduler
from monitors.observation import Latency, Observation, WorkerObservation
from monitors.sampler import LoadWindow
from monitors.window import SnapshotWindow

DONE, WAKE = FIRST_EVENT, FIRST_EVENT + 1
__all__ = ["READY", "SimConfig", "SimResult", "Simulation", "simulate", "plot_timeline"]
QUANTILE_LEVELS = np.linspace(0.0, 1.0, 101)
"""Where the *_percentiles fields of SimConfig sit: percentiles 0, 1, ..., 100."""


@dataclass(frozen=True, slots=True)
class SimConfig(LoopConfig):
    """The simulated embedding server: the loop's settings (sim_loop.LoopConfig), and these."""

    slo_seconds: float = 0.5
    """A request is good when it finishes within this many seconds of arriving."""
    pack_row_tokens: int = packing.DEFAULT_ROW_TOKENS
    """Mixed-length batches run packed into rows of this many tokens (model.pack_row_tokens)."""
    max_inflight_batches: int = INFLIGHT_BATCHES
    """Batches the router lets one worker hold (the engine's)."""
    request_overhead_seconds: float = 0.0
    """Latency each request spends outside the workers (HTTP, tokenizing, hand-offs, response)."""
    model_time_factor: float = 1.0
    """A busy serving worker's batch time over the cost model's, the front process's and a local
    client's share of the cores included (measured by `validate --calibrate`)."""
    request_overhead_percentiles: tuple[float, ...] = ()
    """Percentiles 0..100 of the overhead (101 values): each request draws its own from them.
    Empty: every request takes request_overhead_seconds."""
    model_time_percentiles: tuple[float, ...] = ()
    """Percentiles 0..100 of the busy batch time over the cost model's: each batch draws its
    factor from them, so the simulated tail has the live one's spread (GC, the front's bursts,
    neighbours on the host). Empty: every batch takes model_time_factor."""
    seed: int = 0
    """Seeds those draws: the same config and arrivals give the same run."""

    def __post_init__(self):
        for name in SPREADS:
            check_percentiles(name, getattr(self, name))


@dataclass(slots=True)
class SimWorker:
    worker_id: int
    queue: deque = field(default_factory=deque)
    """Batches assigned but not started (the router's capacity bounds it)."""
    running: Batch | None = None
    busy_seconds: float = 0.0
    """Accumulated at each batch's end, as the live engine does (so busy_fraction reads alike)."""


class SimSampler:
    """Builds the same `Observation` the live sampler does, from the simulation's state."""

    def __init__(self, sim: "Simulation"):
        self.sim = sim
        self.window_seconds = sim.config.window_seconds
        self._load = LoadWindow(self.window_seconds)
        self._busy: dict[int, SnapshotWindow] = {}
        self._recent: deque = deque()
        """(done time, total, queue, model) of completions, oldest first, pruned to the window."""

    def completed(self, done: float, total: float, queue: float, model: float) -> None:
        self._recent.append((done, total, queue, model))

    def sample(self, now: float) -> Observation:
        sim = self.sim
        while self._recent and self._recent[0][0] <= now - self.window_seconds:
            self._recent.popleft()
        oldest = sim.scheduler.batcher.oldest_arrival()
        totals = {**dataclasses.asdict(sim.counters), "rejected": sim.rejected_count, "timed_out": 0}
        queue_wait = 0.0 if oldest is None else now - oldest
        load = self._load.load(now, totals, sim.scheduler.queue_depth(), queue_wait, sim.pending, self._latency())
        return Observation(time=now, window_seconds=self.window_seconds, load=load, workers=self._workers(now))

    def _latency(self) -> dict[str, Latency]:
        if not self._recent:
            return {}
        values = np.array(self._recent, float)
        out = {}
        for column, stage in ((1, "total"), (2, "queue"), (3, "model")):
            p50, p95, p99 = np.percentile(values[:, column], (50, 95, 99))
            out[stage] = Latency(float(p50), float(p95), float(p99), float(values[:, column].mean()), len(values))
        return out

    def _workers(self, now: float) -> tuple[WorkerObservation, ...]:
        router = self.sim.scheduler.router
        out = []
        for slot in router.workers():
            worker = self.sim.workers[slot.worker_id]
            window = self._busy.setdefault(slot.worker_id, SnapshotWindow(self.window_seconds))
            window.push(now, worker.busy_seconds)
            delta = window.delta()
            busy = min(1.0, max(0.0, delta[1] / delta[0])) if delta else 0.0
            out.append(WorkerObservation(slot.worker_id, None, slot.state.value, busy, slot.load))
        for gone in set(self._busy) - {s.worker_id for s in router.workers()}:
            del self._busy[gone]
        return tuple(out)


@dataclass
class SimResult:
    config: SimConfig
    arrival: np.ndarray
    lengths: np.ndarray
    dispatched: np.ndarray
    done: np.ndarray
    """Completion time per request; NaN for rejected ones."""
    rejected: np.ndarray
    knob_changes: list[tuple[float, Knobs]]
    decisions: list[dict]
    decide_calls: int
    batches: int
    items: int
    core_seconds: float
    end_time: float

    def summary(self) -> dict:
        """Throughput, goodput within the SLO, latency percentiles, attainment, cost, knobs."""
        slo = self.config.slo_seconds
        latency = self.done - self.arrival
        ok = ~self.rejected
        finished = latency[ok]
        duration = max(float(self.arrival[-1]) if len(self.arrival) else 0.0, 1e-9)
        good = int(np.sum(finished <= slo))
        p50, p95, p99 = (np.percentile(finished, (50, 95, 99)) if len(finished) else (math.nan,) * 3)
        return {
            "requests": int(len(self.arrival)),
            "completed": int(ok.sum()),
            "rejected": int(self.rejected.sum()),
            "duration_seconds": round(duration, 3),
            "throughput": len(finished) / duration,
            "throughput_in_window": float(np.sum(self.done[ok] <= duration)) / duration,
            "goodput": good / duration,
            "slo_seconds": slo,
            "slo_attainment": good / len(self.arrival) if len(self.arrival) else 1.0,
            "latency_seconds": {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(finished.mean()) if len(finished) else math.nan},
            "queue_wait_mean_seconds": float(np.mean(self.dispatched[ok] - self.arrival[ok])) if len(finished) else math.nan,
            "batches": self.batches,
            "mean_batch_size": self.items / self.batches if self.batches else 0.0,
            "core_seconds": self.core_seconds,
            "cost_per_request": self.core_seconds / good if good else math.inf,
            "decide_calls": self.decide_calls,
            "changes": len(self.knob_changes) - 1,
            "final_knobs": self.knob_changes[-1][1].as_dict(),
            "knob_trajectory": [{"time": round(t, 3), **k.as_dict()} for t, k in self.knob_changes],
            "decisions": self.decisions,
        }


class Simulation(SimLoop):
    """One run: arrivals (sorted (time, tokens)) through the engine's scheduler under a policy.

    `policy=None` runs without sampler or controller (the knobs stay; nothing observes), which
    is what the queueing tests want and what a static policy amounts to.
    """

    def __init__(self, arrivals, cost_model: CostModel, config: SimConfig = SimConfig(), policy=None):
        super().__init__(config, policy)
        self.arrivals = arrivals
        self.cost = cost_model
        self.scheduler = Scheduler("embed", config.knobs, config.max_inflight_batches, config.queue_timeout)
        self.sampler = SimSampler(self) if policy is not None else None
        self._wakes: set[float] = set()
        self._busy = 0
        n = len(arrivals)
        self.arrival = np.array([a[0] for a in arrivals], float)
        self.lengths = np.array([a[1] for a in arrivals], int)
        self.dispatched = np.full(n, math.nan)
        self.done = np.full(n, math.nan)
        self.rejected = np.zeros(n, bool)
        self._rng = np.random.default_rng(config.seed)
        self.overhead = (
            np.interp(self._rng.random(n), QUANTILE_LEVELS, config.request_overhead_percentiles)
            if config.request_overhead_percentiles else np.full(n, config.request_overhead_seconds)
        )

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> SimResult:
        now = self._loop(self.arrival)
        return SimResult(
            self.config, self.arrival, self.lengths, self.dispatched, self.done, self.rejected, self.knob_changes,
            self.decisions, self.controller.calls if self.controller else 0,
            self.counters.batches, self.counters.items, self.core_seconds, now,
        )

    def _new_worker(self, worker_id: int) -> SimWorker:
        return SimWorker(worker_id)

    def _handle_event(self, kind: int, data, now: float) -> None:
        if kind == DONE:
            self._on_done(data[0], data[1], data[2], now)
        elif kind == WAKE:
            self._wakes.discard(now)

    # ---- requests --------------------------------------------------------------------------

    def _on_arrival(self, i: int, now: float) -> None:
        self._admit(i, int(self.lengths[i]), now)

    def _dispatch(self, now: float) -> None:
        for dispatch in self.scheduler.schedule(now):
            batch = dispatch.batch
            for item in batch.items:
                self.dispatched[item.request_id] = now
            self.counters.count_dispatch(batch, self.config.pack_row_tokens)
            worker = self.workers[dispatch.worker_id]
            worker.queue.append(batch)
            if worker.running is None:
                self._start(worker, now)
        wake = self.scheduler.next_wakeup()
        if wake is not None and wake > now and wake not in self._wakes:
            self._wakes.add(wake)
            self._push(wake, WAKE, None)

    def _start(self, worker: SimWorker, now: float) -> None:
        batch = worker.queue.popleft()
        worker.running = batch
        self._busy += 1
        k = self.knobs
        rows, row_length = batch.shape(self.config.pack_row_tokens)
        seconds = self.cost.service_time(rows, row_length, k.threads_per_process, self._busy, self.config.cores)
        spread = self.config.model_time_percentiles
        seconds *= float(np.interp(self._rng.random(), QUANTILE_LEVELS, spread)) if spread else self.config.model_time_factor
        self._push(now + seconds, DONE, (worker.worker_id, batch, seconds))

    def _on_done(self, worker_id: int, batch: Batch, seconds: float, now: float) -> None:
        worker = self.workers[worker_id]
        worker.running = None
        worker.busy_seconds += seconds
        self.counters.count_batch_done(len(batch.items), seconds)
        self._busy -= 1
        self.scheduler.router.complete(worker_id, batch.batch_id)
        for item in batch.items:
            r = item.request_id
            self.done[r] = answered = now + self.overhead[r]
            self.pending -= 1
            self.counters.completed += 1
            if self.sampler is not None:
                self.sampler.completed(now, answered - item.arrival, self.dispatched[r] - item.arrival, seconds)
        if worker.queue:
            self._start(worker, now)


def simulate(arrivals, cost_model: CostModel, config: SimConfig = SimConfig(), policy=None) -> SimResult:
    return Simulation(arrivals, cost_model, config, policy).run()


def plot_timeline(result: SimResult, path: str, bins: int = 300) -> None:
    """Latency percentiles and load over time, with the knobs beneath (one PNG)."""
    from autotune.plots import timeline

    timeline(result.arrival, result.done, ~result.rejected, result.knob_changes, result.config.slo_seconds, path, "simulated seconds", bins, result.end_time)
