"""Discrete-event simulation of the generating engine on a virtual clock.

The same objects decide as in the live server: `engine.scheduler.Scheduler` (router capacity =
running sequences per worker, `reconcile` for the workers), `engine.gen_admission` inside each
worker (who joins the running batch, chunked prefill, preemption under the KV cap), the
policy through the live controller's `DecisionLoop`, the Observation's Load through the live
sampler's `LoadWindow`, the event loop of the embedding simulator (autotune/offline/sim_loop.py).
Only a worker's forward passes are replaced, by the generation cost
model (autotune/offline/gen_costmodel.py). A worker's step is decided when it starts (as the
live runner decides at the start of `step()`); its tokens arrive when it ends.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autotune.offline.gen_costmodel import GenCostModel
from autotune.offline.sim_loop import FIRST_EVENT, LoopConfig, SimLoop
from engine.config import kv_cap, kv_token_slots
from engine.gen_admission import admit, chunk_end, preemptions, prefills_in_chunks, step_budget
from engine.scheduler import Scheduler
from monitors.observation import Latency, Observation, WorkerObservation
from monitors.sampler import LoadWindow
from monitors.window import SnapshotWindow

STEP = FIRST_EVENT


@dataclass(frozen=True, slots=True)
class GenSimConfig(LoopConfig):
    """The simulated generating server: the loop's settings (sim_loop.LoopConfig), and these."""

    ttft_seconds: float = 2.0
    """A request is good when its first token comes within this (and its mean gap within itl_seconds)."""
    itl_seconds: float = 0.25
    kv_cache_mib: int = 1024
    """model.kv_cache_mib: with the cost model's bytes per token, each worker's KV ceiling."""
    speed_noise: float = 0.0
    """A shared VM's speed wanders: every step's time × exp(x), x a stationary Gauss-Markov process
    (its mean factor 1) of this standard deviation, shared by the workers (one machine); 0: none."""
    speed_noise_seconds: float = 10.0
    """The wandering's correlation time: spread over seconds, it gives requests different paces."""
    step_noise: float = 0.0
    """Each step's own lognormal jitter (standard deviation of its log, mean factor 1); 0: none."""
    noise_seed: int = 0


class _Seq:
    __slots__ = ("request_id", "prompt", "max_tokens", "generated", "batch_id")

    def __init__(self, request_id: int, prompt: int, max_tokens: int, batch_id: int):
        self.request_id, self.prompt, self.max_tokens, self.generated, self.batch_id = request_id, prompt, max_tokens, 0, batch_id

    @property
    def context(self) -> int:
        """What a (re-)prefill runs over: the prompt and the tokens made so far."""
        return self.prompt + self.generated

    @property
    def cached(self) -> int:
        """Tokens a running row holds in the cache (the newest is fed at the next step)."""
        return self.prompt + self.generated - 1


@dataclass(frozen=True, slots=True)
class _Step:
    prefill_tokens: int
    rows: int
    columns: int
    emitted: tuple
    """Sequences that made a token this step (each one token)."""


@dataclass(slots=True)
class GenWorker:
    """One worker's runner, as lengths: waiting, running rows (oldest first), a partial prompt."""

    worker_id: int
    waiting: deque = field(default_factory=deque)
    rows: list = field(default_factory=list)
    partial: list | None = None
    """[sequence, prompt tokens prefilled so far]."""
    stepping: bool = False
    busy_seconds: float = 0.0
    preemptions: int = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.rows or self.partial)

    def kv_used(self) -> int:
        used = len(self.rows) * max((s.cached for s in self.rows), default=0)
        return used + (self.partial[1] if self.partial else 0)

    def step(self, max_running: int, chunk: int | None, kv: int | None) -> _Step:
        """What `GenerationRunner.step` does, on lengths, deciding through engine.gen_admission."""
        joined, prefill_tokens = self._prefill(max_running, chunk, kv)
        for s in joined:
            s.generated += 1
        joining = [s for s in joined if s.generated < s.max_tokens]
        width = max((s.cached for s in joining), default=0)
        partial = self.partial[0].context if self.partial else None
        for _ in range(preemptions([s.cached for s in self.rows], len(joining), width, partial, kv)):
            self.waiting.appendleft(self.rows.pop())  # the youngest first: recomputed later over what it made
            self.preemptions += 1
        rows, columns = len(self.rows), max((s.cached for s in self.rows), default=-1) + 1
        for s in self.rows:
            s.generated += 1
        emitted = tuple(self.rows) + tuple(joined)
        self.rows = [s for s in self.rows if s.generated < s.max_tokens] + joining
        return _Step(prefill_tokens, rows, columns, emitted)

    def _prefill(self, max_running: int, chunk: int | None, kv: int | None) -> tuple[list, int]:
        """(sequences whose prefill completes this step, prompt tokens computed: the runner's ragged
        call runs each prompt at its own length, no padding)."""
        chunk = step_budget(chunk, len(self.rows))  # as the runner: no budget to keep while nothing decodes
        if self.partial is None:
            columns = max((s.cached for s in self.rows), default=0)
            count = admit([s.context for s in self.waiting], len(self.rows), columns, max_running, kv, chunk)
            admitted = [self.waiting.popleft() for _ in range(count)]
            if not prefills_in_chunks([s.context for s in admitted], chunk):
                return admitted, sum(s.context for s in admitted)
            self.partial = [admitted[0], 0]
        seq, done = self.partial
        end = chunk_end(done, seq.context, chunk)
        self.partial[1] = end
        if end < seq.context:
            return [], end - done
        self.partial = None
        return [seq], end - done


@dataclass
class GenSimResult:
    config: GenSimConfig
    arrival: np.ndarray
    first: np.ndarray
    """First token time per request (NaN: rejected or never)."""
    done: np.ndarray
    mean_gap: np.ndarray
    """Mean time between a request's tokens (NaN with one token)."""
    itls: np.ndarray
    rejected: np.ndarray
    output_tokens: int
    knob_changes: list
    decisions: list
    decide_calls: int
    preemptions: int
    core_seconds: float
    end_time: float
    shed: int = 0
    """Of the rejected, those refused after waiting the queue limit (the rest: the admission limit)."""

    def summary(self) -> dict:
        """Goodput within both objectives, TTFT / ITL / end-to-end percentiles, knobs; the keys the tuner scores."""
        c = self.config
        ok = ~self.rejected & ~np.isnan(self.done)
        ttft = (self.first - self.arrival)[ok]
        good = int(np.sum((ttft <= c.ttft_seconds) & ~(self.mean_gap[ok] > c.itl_seconds)))
        duration = max(float(self.arrival[-1]) if len(self.arrival) else 0.0, 1e-9)
        e2e = (self.done - self.arrival)[ok]
        return {
            "requests": int(len(self.arrival)), "completed": int(ok.sum()), "rejected": int(self.rejected.sum()), "shed": self.shed,
            "duration_seconds": round(duration, 3), "throughput": float(ok.sum()) / duration,
            "output_tokens_per_s": self.output_tokens / max(self.end_time, 1e-9),
            "goodput": good / duration, "slo_attainment": good / len(self.arrival) if len(self.arrival) else 1.0,
            "ttft_seconds": _percentiles(ttft), "itl_seconds": _percentiles(self.itls),
            "latency_seconds": _percentiles(e2e), "preemptions": self.preemptions,
            "core_seconds": self.core_seconds, "cost_per_request": self.core_seconds / good if good else math.inf,
            "decide_calls": self.decide_calls, "changes": len(self.knob_changes) - 1,
            "final_knobs": self.knob_changes[-1][1].as_dict(),
            "knob_trajectory": [{"time": round(t, 3), **k.as_dict()} for t, k in self.knob_changes],
            "decisions": self.decisions,
        }


def _percentiles(values: np.ndarray) -> dict:
    if not len(values):
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p95, p99 = np.percentile(values, (50, 95, 99))
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(np.mean(values))}


class GenSimSampler:
    """The Observation the live sampler builds, from the simulation: TTFT / ITL / TPOT / total windows,
    the workers' sequences, KV slots and preemptions."""

    def __init__(self, sim: "GenSimulation"):
        self.sim = sim
        self.window_seconds = sim.config.window_seconds
        self._load = LoadWindow(self.window_seconds)
        self._busy: dict[int, SnapshotWindow] = {}
        self.recent: dict[str, deque] = {"ttft": deque(), "itl": deque(), "tpot": deque(), "total": deque()}
        """Stage -> (time, seconds), oldest first, pruned to the window."""

    def sample(self, now: float) -> Observation:
        sim = self.sim
        totals = {**dataclasses.asdict(sim.counters), "rejected": sim.rejected_count, "timed_out": 0}
        oldest = sim.scheduler.batcher.oldest_arrival()
        wait = 0.0 if oldest is None else now - oldest
        load = self._load.load(now, totals, sim.scheduler.queue_depth(), wait, sim.pending, self._latency(now))
        return Observation(time=now, window_seconds=self.window_seconds, load=load, workers=self._workers(now))

    def _latency(self, now: float) -> dict[str, Latency]:
        out = {}
        for stage, recent in self.recent.items():
            while recent and recent[0][0] <= now - self.window_seconds:
                recent.popleft()
            if recent:
                values = np.array([v for _, v in recent])
                p50, p95, p99 = np.percentile(values, (50, 95, 99))
                out[stage] = Latency(float(p50), float(p95), float(p99), float(values.mean()), len(values))
        return out

    def _workers(self, now: float) -> tuple[WorkerObservation, ...]:
        out = []
        for slot in self.sim.scheduler.router.workers():
            w = self.sim.workers[slot.worker_id]
            window = self._busy.setdefault(slot.worker_id, SnapshotWindow(self.window_seconds))
            window.push(now, np.array((w.busy_seconds, w.preemptions), float))
            delta = window.delta()
            busy = min(1.0, max(0.0, delta[1][0] / delta[0])) if delta else 0.0
            out.append(WorkerObservation(
                slot.worker_id, None, slot.state.value, busy, slot.load, running_sequences=len(w.rows) + (w.partial is not None),
                waiting_sequences=len(w.waiting), kv_tokens_used=w.kv_used(), kv_tokens_total=self.sim.kv_tokens or 0,
                preemptions=int(delta[1][1]) if delta else 0,
            ))
        for gone in set(self._busy) - {s.worker_id for s in self.sim.scheduler.router.workers()}:
            del self._busy[gone]
        return tuple(out)


class GenSimulation(SimLoop):
    """One run: arrivals (time, prompt tokens, output tokens) through the engine's scheduler and
    each worker's admission, under a policy (None: the knobs stay, nothing observes)."""

    def __init__(self, arrivals, cost_model: GenCostModel, config: GenSimConfig = GenSimConfig(), policy=None):
        super().__init__(config, policy)
        self.cost = cost_model
        self.scheduler = Scheduler("generate", config.knobs, queue_timeout=config.queue_timeout)
        self.sampler = GenSimSampler(self) if policy is not None else None
        self.output_tokens = 0
        self.ceiling = kv_token_slots(config.kv_cache_mib, cost_model.kv_values_per_token, "float32")
        n = len(arrivals)
        self.arrival = np.array([a[0] for a in arrivals], float)
        self.prompt = np.array([a[1] for a in arrivals], int)
        self.output = np.array([a[2] for a in arrivals], int)
        self.first, self.last, self.done = (np.full(n, math.nan) for _ in range(3))
        self.rejected = np.zeros(n, bool)
        self.itls: list[float] = []
        self._busy = 0
        self._gone_preemptions = 0
        """Preemptions of the workers already stopped."""
        self._speed = SpeedNoise(config.speed_noise, config.speed_noise_seconds, config.step_noise, config.noise_seed)

    @property
    def kv_tokens(self) -> int | None:
        return kv_cap(self.knobs.kv_tokens, self.ceiling)

    def run(self) -> GenSimResult:
        now = self._loop(self.arrival)
        gap = np.where(self.output > 1, (self.last - self.first) / np.maximum(self.output - 1, 1), math.nan)
        return GenSimResult(
            self.config, self.arrival, self.first, self.done, gap, np.array(self.itls), self.rejected, self.output_tokens,
            self.knob_changes, self.decisions, self.controller.calls if self.controller else 0,
            self._gone_preemptions + sum(w.preemptions for w in self.workers.values()), self.core_seconds, now, self.counters.shed,
        )

    def _new_worker(self, worker_id: int) -> GenWorker:
        return GenWorker(worker_id)

    def _retired(self, worker: GenWorker) -> None:
        self._gone_preemptions += worker.preemptions

    def _handle_event(self, kind: int, data, now: float) -> None:
        if kind == STEP:
            self._on_step_done(data[0], data[1], data[2], now)

    def _on_arrival(self, i: int, now: float) -> None:
        self._admit(i, int(self.prompt[i]), now)

    def _on_shed(self, request_id: int, now: float) -> None:
        if self.sampler is not None:  # as engine/generate_jobs.py records a shed request's wait
            self.sampler.recent["ttft"].append((now, now - self.arrival[request_id]))

    def _dispatch(self, now: float) -> None:
        for dispatch in self.scheduler.schedule(now):
            (item,) = dispatch.batch.items
            prompt = int(self.prompt[item.request_id])
            self.counters.batches += 1  # counted as engine/generate_jobs.py counts a sequence sent
            self.counters.items += 1
            self.counters.real_tokens += prompt
            worker = self.workers[dispatch.worker_id]
            worker.waiting.append(_Seq(item.request_id, prompt, int(self.output[item.request_id]), dispatch.batch.batch_id))
            if not worker.stepping:
                self._start_step(worker, now)

    def _start_step(self, worker: GenWorker, now: float) -> None:
        k = self.knobs
        step = worker.step(k.max_batch_size, k.max_batch_tokens or None, self.kv_tokens)
        worker.stepping = True
        self._busy += 1
        seconds = self.cost.step_seconds(step.prefill_tokens, step.rows, step.columns, k.threads_per_process, self._busy, self.config.cores)
        seconds *= self._speed.factor(now)
        self._push(now + seconds, STEP, (worker.worker_id, step, seconds))

    def _on_step_done(self, worker_id: int, step: _Step, seconds: float, now: float) -> None:
        worker = self.workers[worker_id]
        worker.stepping = False
        worker.busy_seconds += seconds
        self._busy -= 1
        for seq in step.emitted:
            self._token(worker_id, seq, now)
        if worker.has_work:
            self._start_step(worker, now)

    def _token(self, worker_id: int, seq: _Seq, now: float) -> None:
        r = seq.request_id
        recent = self.sampler.recent if self.sampler is not None else None
        if math.isnan(self.first[r]):
            self.first[r] = now
            if recent is not None:
                recent["ttft"].append((now, now - self.arrival[r]))
        else:
            self.itls.append(now - self.last[r])
            if recent is not None:
                recent["itl"].append((now, now - self.last[r]))
        self.last[r] = now
        self.output_tokens += 1
        self.counters.generated_tokens += 1
        if seq.generated >= seq.max_tokens:
            self.done[r] = now
            self.pending -= 1
            self.counters.completed += 1
            self.scheduler.router.complete(worker_id, seq.batch_id)
            if recent is not None:
                recent["total"].append((now, now - self.arrival[r]))
                if seq.max_tokens > 1:
                    recent["tpot"].append((now, (now - self.first[r]) / (seq.max_tokens - 1)))


class SpeedNoise:
    """The step-time factor of a machine whose speed wanders (GenSimConfig.speed_noise, step_noise).
    The log factor is an Ornstein-Uhlenbeck process sampled exactly at each step's start, plus a
    step's own jitter; both centred so the factor's mean is 1. Seeded: a run repeats."""

    def __init__(self, sigma: float, seconds: float, step_sigma: float, seed: int):
        self.sigma, self.seconds, self.step_sigma = sigma, max(seconds, 1e-9), step_sigma
        self.rng = np.random.default_rng(seed)
        self.x = self.rng.normal(0.0, sigma) if sigma > 0 else 0.0
        self.at = 0.0

    def factor(self, now: float) -> float:
        if self.sigma > 0:
            keep = math.exp(-max(now - self.at, 0.0) / self.seconds)
            self.x = self.x * keep + self.sigma * math.sqrt(1.0 - keep * keep) * self.rng.normal()
            self.at = now
        jitter = self.rng.normal(0.0, self.step_sigma) if self.step_sigma > 0 else 0.0
        return math.exp(self.x + jitter - (self.sigma ** 2 + self.step_sigma ** 2) / 2)


def simulate_generation(arrivals, cost_model: GenCostModel, config: GenSimConfig = GenSimConfig(), policy=None) -> GenSimResult:
    return GenSimulation(arrivals, cost_model, config, policy).run()
