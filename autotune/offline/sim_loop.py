"""What the embedding and the generation simulators share: the events on a virtual clock, the
engine's `EngineCore` turn (an event, then `Scheduler.reconcile`, then dispatch), admission at
arrival, core-seconds held, and the sampler tick that drives the live controller's `DecisionLoop`.
A subclass says what its workers are and what its events do.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from autotune.controller import ControllerConfig, DecisionLoop
from autotune.guardrails import MachineLimits
from engine.batcher import Item
from engine.config import Bounds, Knobs
from engine.stats import Counters

@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The simulated server's settings both simulators have, the live config's defaults."""

    knobs: Knobs = field(default_factory=Knobs)
    bounds: Bounds = field(default_factory=Bounds)
    cores: int = 2
    """Cores the workers share (the cost model's contention and the guardrails' core limit)."""
    startup_seconds: float = 1.0
    """Fork + warm-up time before a new worker takes traffic."""
    max_queued_requests: int = 512
    """Admission limit (limits.max_queued_requests): arrivals beyond it are rejected, as with a 429."""
    queue_timeout: float | None = None
    """limits.queue_timeout_seconds: a request still queued for a worker after this is refused (a 429)."""
    sample_interval: float = 1.0
    """monitors.interval_seconds: how often an Observation is taken."""
    window_seconds: float = 10.0
    """monitors.window_seconds: rates and percentiles are over this window."""
    control_interval: float = 2.0
    """autotune.interval_seconds: decide at most this often."""
    cooldown_seconds: float = 4.0
    """autotune.cooldown_seconds: wait after a change before the next decision."""
    allow_oversubscription: bool = False
    pinned: frozenset = frozenset()


READY, SAMPLE = 0, 1
"""The events every simulator has; a subclass numbers its own from FIRST_EVENT."""
FIRST_EVENT = 2


class SimLoop:
    """The loop; a subclass sets `scheduler`, `sampler` (None without a policy) and the arrays,
    and implements `_new_worker`, `_handle_event` and `_dispatch`."""

    def __init__(self, config: LoopConfig, policy):
        self.config = config
        self.policy = policy
        self.knobs: Knobs = config.knobs
        self.workers: dict = {}
        self.counters = Counters()
        self.rejected_count = 0
        self.pending = 0
        self.controller = DecisionLoop(policy, config.bounds, controller_config(config)) if policy is not None else None
        self.decisions: list[dict] = []
        self.knob_changes: list[tuple[float, Knobs]] = [(0.0, config.knobs)]
        self.core_seconds = 0.0
        self._last_t = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def _loop(self, arrival) -> float:
        """Every arrival and event in time order; returns the time of the last one."""
        i, n, now = 0, len(arrival), 0.0
        if self.sampler is not None:
            self._push(self.config.sample_interval, SAMPLE, None)
        self._reconcile(now)
        for worker_id in list(self.workers):  # the server starts serving once its workers are warm
            self._handle(READY, worker_id, now)
        while True:
            next_arrival = arrival[i] if i < n else math.inf
            next_event = self._events[0][0] if self._events else math.inf
            if next_arrival == math.inf and next_event == math.inf:
                return now
            if next_arrival <= next_event:
                now = float(next_arrival)
                self._account(now)
                self._on_arrival(i, now)
                i += 1
            else:
                now, _, kind, data = heapq.heappop(self._events)
                self._account(now)
                if kind == SAMPLE and not self._on_sample(now, more=i < n):
                    continue
                self._handle(kind, data, now)
            self._reconcile(now)
            self._shed(now)
            self._dispatch(now)

    def _push(self, t: float, kind: int, data) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def _account(self, now: float) -> None:
        """Core-seconds held: worker processes alive × threads each, integrated over time."""
        self.core_seconds += (now - self._last_t) * len(self.workers) * self.knobs.threads_per_process
        self._last_t = now

    def _handle(self, kind: int, data, now: float) -> None:
        if kind == READY:
            if data in self.workers:
                self.scheduler.router.mark_ready(data)
        else:
            self._handle_event(kind, data, now)

    def _admit(self, i: int, length: int, now: float) -> None:
        """An arrival: rejected past the admission limit (a 429), else queued in the batcher."""
        if self.pending >= self.config.max_queued_requests:
            self.rejected[i] = True
            self.rejected_count += 1
            return
        self.pending += 1
        self.counters.requests += 1
        self.scheduler.submit(Item(i, 0, length, now))

    def _shed(self, now: float) -> None:
        """Refuse what waited its queue limit, as EngineCore's turn does before it dispatches (here
        at the next event rather than at the limit itself: nothing is dispatched in between)."""
        for item in self.scheduler.shed(now):
            self.rejected[item.request_id] = True
            self.counters.shed += 1  # rejected_count stays the admission's, as the live HTTP layer counts it
            self.pending -= 1
            self._on_shed(item.request_id, now)

    def _on_shed(self, request_id: int, now: float) -> None:
        """A request was shed (a subclass records what the live engine records)."""

    def _reconcile(self, now: float) -> None:
        """Carry out the scheduler's plan as EngineCore's supervisor does: start, stop (drains
        need nothing here; a draining worker still warming up stops once ready)."""
        plan = self.scheduler.reconcile(self.knobs.process_count)
        for worker_id in plan.start:
            self.workers[worker_id] = self._new_worker(worker_id)
            self._push(now + self.config.startup_seconds, READY, worker_id)
        for worker_id in plan.stop:
            self.scheduler.router.remove(worker_id)
            self._retired(self.workers.pop(worker_id))

    def _retired(self, worker) -> None:
        """A worker stopped (a subclass keeps what it must of it)."""

    def _on_sample(self, now: float, more: bool) -> bool:
        """Observe, let the controller decide; False once there is nothing left to observe."""
        if not more and self.pending == 0:
            return False
        self._push(now + self.config.sample_interval, SAMPLE, None)
        step = self.controller.step(self.sampler.sample(now), self.knobs, set(self.config.pinned))
        if step.entry is not None:
            self.decisions.append(step.entry)
        if step.knobs is not None:
            self.controller.applied(now)
            self.knobs = step.knobs
            self.scheduler.configure(step.knobs)
            self.knob_changes.append((now, step.knobs))
        return True


def controller_config(config: LoopConfig) -> ControllerConfig:
    limits = MachineLimits(usable_cores=config.cores, allow_oversubscription=config.allow_oversubscription)
    return ControllerConfig(interval_seconds=config.control_interval, cooldown_seconds=config.cooldown_seconds, limits=limits)
