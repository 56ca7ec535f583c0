"""EngineCore: the front process's event loop that owns the scheduler, the workers and the jobs.

One thread owns all engine state (like an actor): callers talk to it through an inbox, and it
waits on the inbox, the zygote's socket, every worker's socket and every worker's pidfd at
once, with a timeout set by the batcher's next due time. Each turn: handle what happened, then
reconcile the worker count with the knobs (the supervisor), then dispatch what the scheduler
says (the task's jobs). Threads that wait on the core (ready workers, drained requests) wait
on its condition, notified at the end of the turn that changed what they wait for.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Callable

from engine.config import EngineConfig, Knobs
from engine.embed_jobs import EmbedJobs
from engine.generate_jobs import GenerateJobs
from engine.jobs import EmbedJob, EngineClosed, GenerateJob
from engine.lifecycle import EngineState
from engine.loading import ModelInfo
from engine.router import WorkerState
from engine.scheduler import Scheduler
from engine.stats import Counters, EngineStats, LatencyHistograms
from engine.supervisor import WorkerSupervisor

log = logging.getLogger("selftune.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo, zygote: Connection, device: str, knobs: Knobs, latency: LatencyHistograms):
        self.config = config
        self.knobs = knobs
        self.scheduler = Scheduler(config.task, knobs, config.max_inflight_batches, config.queue_timeout)
        self.counters = Counters()
        self.state = EngineState.SERVING
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._deferrable = 0
        """Items the front may put in the inbox without a wake-up (published at the end of a turn)."""
        self._deferred = 0
        """Items put without a wake-up since the core last drained the inbox."""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_inbox)
        self.supervisor = WorkerSupervisor(config, info, device, zygote, self.scheduler, self.counters, self._selector, knobs, self._on_fatal)
        jobs_type = EmbedJobs if config.task == "embed" else GenerateJobs
        self.jobs = jobs_type(config, info, self.scheduler, self.counters, latency, self.supervisor)
        self.supervisor.jobs = self.jobs
        self.changed = threading.Condition()
        """Notified when ready_workers, pending, crash_loop or state change (at the end of a turn)."""
        self.ready_workers = 0
        self.pending = 0
        self.crash_loop: str | None = None
        """The supervisor's reason, once it stopped replacing workers."""

    # ---- called from other threads -------------------------------------------------------

    def call(self, fn, *args, defer_items: int = 0) -> Future:
        """Run fn(*args) on the core thread; the future carries its result. A call that brings
        `defer_items` embedding items skips the wake-up while the scheduler said that many may wait
        for a turn that is coming anyway (`Scheduler.deferrable_items`), so at a high rate the core
        turns per batch rather than per request."""
        future: Future = Future()
        self._inbox.put((future, fn, args))
        if self.state is EngineState.STOPPED:
            # The loop has ended or is ending: refuse from this thread, since no turn will come. Put
            # first, read the state second; the loop sets it before its last drain, so one of the
            # two drains takes the call.
            self._drain_inbox()
            return future
        if defer_items:
            # Put first, read the gate second; the core publishes the gate before it looks at the
            # inbox. Under the GIL one of the two sees the other, so no item waits on a turn that
            # does not come. A count lost between threads only wakes the core later than the
            # fill rule would, never past the turn that is coming.
            self._deferred += defer_items
            if self._deferred <= self._deferrable:
                return future
        if not self._wake_pending:  # one wake-up per loop turn is enough
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already
        return future

    def wait_for(self, predicate: Callable[["EngineCore"], bool], timeout: float) -> bool:
        """Block until predicate(core) holds (checked at each change), or the loop stopped, or
        `timeout` passed; returns the predicate's last value."""
        with self.changed:
            self.changed.wait_for(lambda: predicate(self) or self.state is EngineState.STOPPED, timeout)
            return predicate(self)

    # ---- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self.state is not EngineState.STOPPED:
                self._turn()
        except Exception:
            log.exception("engine core crashed")
            self._fail_everything(EngineClosed("the engine's core loop crashed; see the server log"))
            raise
        finally:
            self.state = EngineState.STOPPED
            self._drain_inbox()  # what came in during the last turn is refused, not left waiting
            self._publish()
            self.supervisor.release_all()
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self) -> None:
        timeout = 0.0 if not self._inbox.empty() else self._timeout(time.monotonic())
        for key, _ in self._selector.select(timeout):
            key.data()
        self._drain_inbox()
        now = time.monotonic()
        if self.state is EngineState.SERVING:
            self.supervisor.reconcile(now)
        shed = self.scheduler.shed(now)
        if shed:
            self.jobs.shed(shed, now)
        for dispatch in self.scheduler.schedule(now):
            self.jobs.send(self.supervisor.workers[dispatch.worker_id], dispatch.batch, now)
        self._deferrable = self.scheduler.deferrable_items() if self.state is EngineState.SERVING else 0
        self._publish()

    def _timeout(self, now: float) -> float | None:
        respawn = self.supervisor.respawn_due() if self.state is EngineState.SERVING else None
        due = [t for t in (self.scheduler.next_wakeup(), respawn) if t is not None]
        return max(0.0, min(due) - now) if due else None

    def _publish(self) -> None:
        ready = sum(1 for s in self.scheduler.router.workers() if s.state is WorkerState.READY)
        now = (ready, self.jobs.pending(), self.supervisor.crash_loop)
        if now != (self.ready_workers, self.pending, self.crash_loop) or self.state is EngineState.STOPPED:
            with self.changed:
                self.ready_workers, self.pending, self.crash_loop = now
                self.changed.notify_all()

    def _on_inbox(self) -> None:
        os.read(self._wake_r, 4096)
        self._wake_pending = False  # cleared before the drain, so a later call writes again

    def _drain_inbox(self) -> None:
        """Run every call in the inbox, woken for or not; after the loop stopped, refuse them."""
        self._deferred = 0
        while True:
            try:
                future, fn, args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            if self.state is EngineState.STOPPED:
                future.set_exception(EngineClosed("the engine shut down before this request was taken"))
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    # ---- requests (run on the core thread through `call`) ---------------------------------

    def _check_serving(self) -> None:
        if self.state is not EngineState.SERVING:
            raise EngineClosed("the engine is shutting down")

    def submit_embed(self, job: EmbedJob, token_ids: list[list[int]]) -> None:
        self._check_serving()
        self.jobs.submit(job, token_ids)

    def submit_generate(self, job: GenerateJob) -> None:
        self._check_serving()
        self.jobs.submit(job)

    def cancel(self, request_id: int) -> bool:
        """Drop a request's queued work and stop its generation; its caller gets nothing more."""
        if not self.jobs.cancel(request_id):
            return False
        self.counters.cancelled += 1
        return True

    def set_knobs(self, knobs: Knobs) -> None:
        """Batching changes at once; workers get theirs (threads, CPUs) at the end of this turn."""
        self.knobs = knobs
        self.supervisor.knobs = knobs
        self.scheduler.configure(knobs)

    def pending_requests(self) -> int:
        return self.jobs.pending()

    def begin_close(self) -> None:
        """Take no new requests; what is queued or running goes on."""
        if self.state is EngineState.SERVING:
            self.state = EngineState.CLOSING

    def stop(self, timeout: float = 5.0) -> None:
        """Fail whatever is left, stop every worker (SIGKILL after `timeout`), leave the loop."""
        self.begin_close()
        self._fail_everything(EngineClosed("the engine shut down before this request finished"))
        self.supervisor.stop_all(timeout)
        self.state = EngineState.STOPPED

    def stats(self) -> EngineStats:
        now = time.monotonic()
        workers = self.supervisor.worker_stats(now)
        oldest = self.scheduler.batcher.oldest_arrival()
        return EngineStats(
            knobs=self.knobs,
            queue_depth=self.scheduler.queue_depth(),
            oldest_wait_seconds=0.0 if oldest is None else max(0.0, now - oldest),
            pending_requests=self.jobs.pending(),
            ready_workers=sum(1 for w in workers if w.state == WorkerState.READY.value),
            workers=workers,
            counters=self.counters.copy(),
            crash_loop=self.supervisor.crash_loop,
            placement=self.supervisor.plan().as_dict(),
        )

    # ---- endings ----------------------------------------------------------------------------

    def _on_fatal(self, error: Exception, stop_loop: bool) -> None:
        self._fail_everything(error)
        if stop_loop:
            self.state = EngineState.STOPPED

    def _fail_everything(self, error: Exception) -> None:
        self.jobs.fail_all(error)
        self.scheduler.batcher.clear()
