"""WorkerSupervisor: the worker processes as the front process sees them, on the core thread.

It carries out the scheduler's `reconcile` (fork through the zygote, drain, stop), places each
worker (CPUs, NUMA node, GPU) and keeps its threads and batch size in step with the knobs,
reads what workers say, and handles their deaths: re-queue, restart with backoff, and stop
restarting in a crash loop. What a result means for a request is the task's (`TaskJobs`).
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import signal
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle
from typing import TYPE_CHECKING, Callable

from engine import messages as m
from engine.batcher import Batch
from engine.config import EngineConfig, Knobs
from engine.jobs import EngineClosed
from engine.loading import ModelInfo
from engine.placement import PlacementError, PlacementPlan, WorkerPlacement, affinity_topology, format_cpulist, plan_placement
from engine.scheduler import Scheduler
from engine.shm import SlotBuffer
from engine.stats import Counters, WorkerStats

if TYPE_CHECKING:
    from engine.task_jobs import TaskJobs

log = logging.getLogger("selftune.engine")


@dataclass(slots=True)
class WorkerHandle:
    """The front process's view of one worker process."""

    worker_id: int
    forked_at: float
    pid: int | None = None
    conn: Connection | None = None
    pidfd: int | None = None
    shm: SlotBuffer | None = None
    free_slots: list[int] = field(default_factory=list)
    batches: dict[int, tuple[Batch, int, float]] = field(default_factory=dict)
    """batch_id -> (batch, slot, dispatched at)."""
    ready_at: float | None = None
    stop_sent: bool = False
    applied: m.SetKnobs = m.SetKnobs(0, 0)
    """The live settings last given to the worker."""
    busy_seconds: float = 0.0
    batches_done: int = 0
    items_done: int = 0
    generation: m.GenerationLoad = m.GenerationLoad()
    """A generation worker's last reported state."""


class WorkerSupervisor:
    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        device: str,
        zygote: Connection,
        scheduler: Scheduler,
        counters: Counters,
        selector: selectors.BaseSelector,
        knobs: Knobs,
        on_fatal: Callable[[Exception, bool], None],
    ):
        self.config = config
        self.info = info
        self.device = device
        self.zygote = zygote
        self.scheduler = scheduler
        self.counters = counters
        self.knobs = knobs
        self.jobs: TaskJobs | None = None
        """The task's requests; set by the core before the first turn."""
        self._selector = selector
        self._on_fatal = on_fatal
        """Fail every request with the error; True also stops the loop (the zygote is gone)."""
        self.workers: dict[int, WorkerHandle] = {}
        self.topology = config.topology if config.topology is not None else affinity_topology()
        self._respawn_at = 0.0
        self._backoff = config.restart_backoff[0]
        self._deaths: collections.deque[float] = collections.deque()
        self._plan_key: tuple[int, int] | None = None
        self._placement: PlacementPlan | None = None
        self.crash_loop: str | None = None
        """Why the engine stopped replacing workers, once it has."""
        selector.register(zygote, selectors.EVENT_READ, self._on_zygote)

    # ---- reconcile: start, drain, stop ------------------------------------------------------

    def respawn_due(self) -> float | None:
        """When the next start is allowed, if a worker is missing and starts are not given up."""
        if self.crash_loop is None and len(self.scheduler.router.active()) < self.knobs.process_count:
            return self._respawn_at
        return None

    def reconcile(self, now: float) -> None:
        """Carry out the scheduler's plan, then send live workers any changed settings."""
        if self.crash_loop is not None:
            return
        plan = self.scheduler.reconcile(self.knobs.process_count, may_start=now >= self._respawn_at)
        for worker_id in plan.start:
            self._fork(worker_id, now)
        for worker_id in plan.drained:
            log.info("worker %d draining (process_count=%d)", worker_id, self.knobs.process_count)
        for worker_id in plan.stop:
            handle = self.workers[worker_id]
            if not handle.stop_sent:
                handle.stop_sent = True
                self.send(handle, m.Stop())
        self._sync_workers()

    def _fork(self, worker_id: int, now: float) -> None:
        handle = WorkerHandle(worker_id, forked_at=now)
        self.workers[worker_id] = handle
        self.counters.workers_started += 1
        placement = self._placement_of(worker_id)
        handle.applied = self._desired(handle)
        device = self.device
        if placement is not None and placement.gpu is not None:
            device = f"cuda:{placement.gpu}"
        spec = m.WorkerSpec(
            worker_id=worker_id,
            task=self.config.task,
            device=device,
            threads=handle.applied.threads,
            max_batch_size=handle.applied.max_batch_size,
            slots=self.config.max_inflight_batches,
            slot_items=self.config.bounds.max_batch_size[1],
            max_length=self.info.max_length,
            hidden_size=self.info.hidden_size,
            eos_token_ids=self.info.eos_token_ids,
            warmup=self.config.warmup,
            pack_row_tokens=self.config.pack_row_tokens,
            vocab_size=self.info.vocab_size,
            cpus=handle.applied.cpus,
            numa_node=placement.node if placement is not None else None,
            kv_tokens=self.info.kv_tokens if self.config.task == "generate" else None,
            kv_knob=handle.applied.kv_tokens,
            max_batch_tokens=handle.applied.max_batch_tokens,
        )
        self.zygote.send(m.Fork(spec))

    # ---- placement and live settings ----------------------------------------------------------

    def plan(self) -> PlacementPlan:
        """The placement for the current process_count × threads_per_process (cached)."""
        key = (self.knobs.process_count, self.knobs.threads_per_process)
        if self._plan_key != key:
            self._plan_key = key
            self._placement = self._make_plan(*key)
            for line in self._placement.describe():
                log.info("placement: %s", line)
        return self._placement

    def _make_plan(self, workers: int, threads: int) -> PlacementPlan:
        c = self.config
        try:
            return plan_placement(self.topology, workers, threads, c.placement, self.device, c.workers_per_gpu, c.placement_cpus)
        except PlacementError as exc:
            log.error("placement %s impossible for %d x %d (%s); not pinning", c.placement, workers, threads, exc)
            return plan_placement(self.topology, workers, threads, "none", self.device, c.workers_per_gpu)

    def _placement_of(self, worker_id: int) -> WorkerPlacement | None:
        """Active workers take the plan's slots in the order they were started."""
        active = sorted(slot.worker_id for slot in self.scheduler.router.active())
        if worker_id not in active:
            return None  # draining: keeps its CPUs until it exits
        index = active.index(worker_id)
        workers = self.plan().workers
        return workers[index] if index < len(workers) else None

    def _desired(self, handle: WorkerHandle) -> m.SetKnobs:
        placement = self._placement_of(handle.worker_id)
        cpus = placement.cpus if placement is not None else handle.applied.cpus
        k = self.knobs
        return m.SetKnobs(k.threads_per_process, k.max_batch_size, cpus, k.max_batch_tokens, k.kv_tokens)

    def _sync_workers(self) -> None:
        """Send each live worker its threads, batch size, generation knobs and CPUs when they changed.

        A draining worker keeps what it has: it only finishes its work, on its own CPUs. While one
        drains, the others take no more threads or CPUs than they had: those cores are still
        busy, and OpenMP threads sharing a core spin at each other's barriers (a 2 × 1 -> 1 × 2
        move that grew the kept worker at once stalled every stream for seconds). They grow when
        the drain is over; fewer threads are applied at once."""
        active = {slot.worker_id for slot in self.scheduler.router.active()}
        draining = any(w not in active for w in self.workers)
        for handle in list(self.workers.values()):
            if handle.conn is None or handle.stop_sent or handle.worker_id not in active:
                continue
            desired = self._desired(handle)
            if draining and desired.threads > handle.applied.threads:
                desired = replace(desired, threads=handle.applied.threads, cpus=handle.applied.cpus)
            if desired != handle.applied:
                handle.applied = desired
                self.send(handle, desired)

    # ---- what the zygote and the workers say ----------------------------------------------------

    def _on_zygote(self) -> None:
        try:
            msg = self.zygote.recv()
        except (EOFError, OSError):
            log.error("the zygote process died; no new workers can start")
            self._on_fatal(EngineClosed("the engine's zygote process died"), True)
            return
        if not isinstance(msg, m.Forked):
            log.error("the zygote sent an unknown message %s; refused", type(msg).__name__)
            return
        fd = recv_handle(self.zygote)
        handle = self.workers.get(msg.worker_id)
        if handle is None:
            os.close(fd)
            os.kill(msg.pid, signal.SIGKILL)
            return
        handle.pid = msg.pid
        handle.conn = Connection(fd)
        self._selector.register(handle.conn, selectors.EVENT_READ, lambda: self._on_worker_message(handle))
        try:
            handle.pidfd = os.pidfd_open(msg.pid)
        except ProcessLookupError:
            self._on_worker_exit(handle, "exited before it could be watched")
            return
        self._selector.register(handle.pidfd, selectors.EVENT_READ, lambda: self._on_worker_exit(handle, "process exited"))

    def _on_worker_message(self, handle: WorkerHandle) -> None:
        if handle.conn is None:
            return  # it died earlier in this same turn
        try:
            msg = handle.conn.recv()
        except (EOFError, OSError):
            self._on_worker_exit(handle, "closed its connection")
            return
        if isinstance(msg, self.jobs.result_type):
            self.jobs.on_result(handle, msg)
        elif isinstance(msg, m.WorkFailed):
            self.jobs.on_failed(handle, msg)
        elif isinstance(msg, m.Hello):
            self._on_hello(handle, msg)
        elif isinstance(msg, m.Ready):
            handle.ready_at = time.monotonic()
            self.scheduler.router.mark_ready(handle.worker_id)
            self._backoff = self.config.restart_backoff[0]
            log.info("worker %d (pid %d) ready after %.2fs warm-up", handle.worker_id, handle.pid, msg.warmup_seconds)
        else:
            log.error("worker %d sent an unknown message %s; refused", handle.worker_id, type(msg).__name__)

    def _on_hello(self, handle: WorkerHandle, msg: m.Hello) -> None:
        if msg.shm_bytes:
            fd = recv_handle(handle.conn)
            c = self.config
            handle.shm = SlotBuffer(fd, c.max_inflight_batches, c.bounds.max_batch_size[1], self.info.max_length, self.info.hidden_size)
            handle.free_slots = list(range(c.max_inflight_batches))

    def finish_work(self, handle: WorkerHandle, key: int, items: int, model_seconds: float) -> None:
        """A batch or sequence left the worker: free its place and count it."""
        self.scheduler.router.complete(handle.worker_id, key)
        handle.busy_seconds += model_seconds
        handle.batches_done += 1
        handle.items_done += items

    def send(self, handle: WorkerHandle, msg) -> bool:
        try:
            handle.conn.send(msg)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._on_worker_exit(handle, "its connection broke")
            return False

    # ---- deaths and exits -------------------------------------------------------------------------

    def _on_worker_exit(self, handle: WorkerHandle, why: str) -> None:
        if handle.worker_id not in self.workers:
            return
        expected = handle.stop_sent
        leftover = self.scheduler.router.remove(handle.worker_id)
        del self.workers[handle.worker_id]
        self._close_handle(handle)
        if expected and not leftover:
            log.info("worker %d (pid %s) stopped", handle.worker_id, handle.pid)
            return
        self.counters.worker_deaths += 1
        log.warning("worker %d (pid %s) died (%s) holding %d batches; re-running what can be", handle.worker_id, handle.pid, why, len(leftover))
        now = time.monotonic()
        self._note_death(now)
        requeue = self.jobs.recover(handle)
        self.counters.requeued_items += len(requeue)
        self.scheduler.batcher.requeue(requeue)
        self._respawn_at = now + self._backoff
        self._backoff = min(self._backoff * 2, self.config.restart_backoff[1])

    def _note_death(self, now: float) -> None:
        limit, window = self.config.crash_loop
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - window:
            self._deaths.popleft()
        if len(self._deaths) >= limit and self.crash_loop is None:
            self.crash_loop = f"{len(self._deaths)} workers died within {window:g}s: not starting more (crash loop); see the log"
            log.error("%s", self.crash_loop)
            if not self.scheduler.router.active():
                self._on_fatal(EngineClosed(self.crash_loop), False)

    def stop_all(self, timeout: float) -> None:
        """Tell every worker to stop; SIGKILL those still there after `timeout`."""
        for handle in list(self.workers.values()):
            if handle.conn is not None and not handle.stop_sent:
                handle.stop_sent = True
                self.send(handle, m.Stop())
        deadline = time.monotonic() + timeout
        while True:
            pidfds = {h.pidfd: h for h in self.workers.values() if h.pidfd is not None}
            if not pidfds:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for handle in pidfds.values():
                    log.warning("worker %d did not stop in time; killing it", handle.worker_id)
                    os.kill(handle.pid, signal.SIGKILL)
                left = 5.0
            for fd in wait(list(pidfds), left):
                handle = pidfds[fd]
                self.scheduler.router.remove(handle.worker_id)
                del self.workers[handle.worker_id]
                self._close_handle(handle)

    def _close_handle(self, handle: WorkerHandle) -> None:
        if handle.conn is not None:
            self._selector.unregister(handle.conn)
            handle.conn.close()
        if handle.pidfd is not None:
            self._selector.unregister(handle.pidfd)
            os.close(handle.pidfd)
        if handle.shm is not None:
            handle.shm.close()
        handle.conn = None
        handle.pidfd = None
        handle.shm = None

    def release_all(self) -> None:
        for handle in list(self.workers.values()):
            self._close_handle(handle)

    def worker_stats(self, now: float) -> tuple[WorkerStats, ...]:
        out = []
        for slot in self.scheduler.router.workers():
            h = self.workers[slot.worker_id]
            out.append(
                WorkerStats(
                    worker_id=h.worker_id,
                    pid=h.pid,
                    state=slot.state.value,
                    load=slot.load,
                    queued_items=slot.items,
                    batches=h.batches_done,
                    items=h.items_done,
                    busy_seconds=h.busy_seconds,
                    age_seconds=now - h.forked_at,
                    cpus=format_cpulist(h.applied.cpus),
                    running_sequences=h.generation.running,
                    waiting_sequences=h.generation.waiting,
                    kv_tokens_used=h.generation.kv_tokens_used,
                    kv_tokens_total=h.generation.kv_tokens_total,
                    preemptions=h.generation.preemptions,
                    max_running_sequences=h.generation.max_running,
                    max_batch_tokens=h.generation.max_batch_tokens,
                )
            )
        return tuple(out)
