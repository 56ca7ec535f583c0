"""EngineCore: the front process's event loop that owns the scheduler and the workers.

One thread owns all engine state (like an actor): callers talk to it through an inbox, and it
waits on the inbox, the zygote's socket, every worker's socket and every worker's pidfd at
once, with a timeout set by the batcher's next due time. Each turn: handle what happened, then
reconcile the worker count with the knobs, then dispatch what the scheduler says.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import selectors
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle

from engine import messages as m
from engine.batcher import Batch, Item
from engine.config import EngineConfig, Knobs
from engine.jobs import (
    EmbedJob,
    EmbedResult,
    RequestTimings,
    EngineClosed,
    GenerateJob,
    ModelFailed,
    TokenEvent,
    WorkerLost,
)
from engine.loading import ModelInfo
from engine.placement import PlacementError, PlacementPlan, WorkerPlacement, affinity_topology, format_cpulist, plan_placement
from engine.router import WorkerState
from engine.scheduler import Scheduler
from engine.shm import SlotBuffer
from engine.stats import Counters, EngineStats, LatencyHistograms, WorkerStats

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
    applied: tuple[int, int, tuple[int, ...]] = (0, 0, ())
    """(threads, max_batch_size, cpus) last given to the worker."""
    busy_seconds: float = 0.0
    batches_done: int = 0
    items_done: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo, zygote: Connection, device: str, knobs: Knobs, latency: LatencyHistograms):
        self.config = config
        self.device = device
        self.info = info
        self.zygote = zygote
        self.knobs = knobs
        self.latency = latency
        self.scheduler = Scheduler(config.task, knobs, config.max_inflight_batches)
        self.workers: dict[int, WorkerHandle] = {}
        self.embed_jobs: dict[int, EmbedJob] = {}
        self.gen_jobs: dict[int, GenerateJob] = {}
        self.counters = Counters()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_inbox)
        self._selector.register(zygote, selectors.EVENT_READ, self._on_zygote)
        self._next_worker_id = 0
        self._respawn_at = 0.0
        self._backoff = config.restart_backoff[0]
        self._running = True
        self._closing = False
        self.topology = config.topology if config.topology is not None else affinity_topology()
        self._plan_key: tuple[int, int] | None = None
        self._placement: PlacementPlan | None = None
        self._deaths: collections.deque[float] = collections.deque()
        self.crash_loop: str | None = None
        """Why the engine stopped replacing workers, once it has."""

    # ---- called from other threads -------------------------------------------------------

    def call(self, fn, *args) -> Future:
        """Run fn(*args) on the core thread; the future carries its result."""
        future: Future = Future()
        self._inbox.put((future, fn, args))
        if not self._wake_pending:  # one wake-up per loop turn is enough
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already
        return future

    # ---- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self._running:
                self._turn()
        except Exception:
            log.exception("engine core crashed")
            self._fail_everything(EngineClosed("the engine's core loop crashed; see the server log"))
            raise
        finally:
            self._release_all()

    def _turn(self) -> None:
        timeout = self._timeout(time.monotonic())
        for key, _ in self._selector.select(timeout):
            key.data()
        now = time.monotonic()
        self._reconcile(now)
        self._dispatch(now)

    def _timeout(self, now: float) -> float | None:
        due = [t for t in (self.scheduler.next_wakeup(), self._respawn_at_if_needed()) if t is not None]
        return max(0.0, min(due) - now) if due else None

    def _respawn_at_if_needed(self) -> float | None:
        if self.crash_loop is not None:
            return None
        if len(self.scheduler.router.active()) < self.knobs.process_count and not self._closing:
            return self._respawn_at
        return None

    def _on_inbox(self) -> None:
        os.read(self._wake_r, 4096)
        self._wake_pending = False  # cleared before draining, so a later call writes again
        while True:
            try:
                future, fn, args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    # ---- requests (run on the core thread through `call`) ---------------------------------

    def submit_embed(self, job: EmbedJob, token_ids: list[list[int]]) -> None:
        if self._closing:
            raise EngineClosed("the engine is shutting down")
        self.embed_jobs[job.request_id] = job
        self.counters.requests += 1
        for index, ids in enumerate(token_ids):
            self.scheduler.submit(Item(job.request_id, index, len(ids), job.submitted, ids))

    def submit_generate(self, job: GenerateJob) -> None:
        if self._closing:
            raise EngineClosed("the engine is shutting down")
        self.gen_jobs[job.request_id] = job
        self.counters.requests += 1
        self.scheduler.submit(job.item)

    def cancel(self, request_id: int) -> bool:
        """Drop a request's queued work and stop its generation; its caller gets nothing more."""
        self.scheduler.batcher.cancel(request_id)
        job = self.embed_jobs.pop(request_id, None) or self.gen_jobs.pop(request_id, None)
        if job is None:
            return False
        self.counters.cancelled += 1
        if isinstance(job, GenerateJob) and job.worker_id is not None:
            handle = self.workers.get(job.worker_id)
            self.scheduler.router.complete(job.worker_id, job.batch_id)
            if handle is not None and handle.conn is not None:
                handle.batches.pop(job.batch_id, None)
                self._send(handle, m.AbortSequence(request_id))
        return True

    def set_knobs(self, knobs: Knobs) -> None:
        """Batching changes at once; workers get theirs (threads, CPUs) at the end of this turn."""
        self.knobs = knobs
        self.scheduler.configure(knobs)

    def pending_requests(self) -> int:
        return len(self.embed_jobs) + len(self.gen_jobs)

    def begin_close(self) -> None:
        """Take no new requests; what is queued or running goes on."""
        self._closing = True

    def stop(self, timeout: float = 5.0) -> None:
        """Fail whatever is left, stop every worker (SIGKILL after `timeout`), leave the loop."""
        self._closing = True
        self._fail_everything(EngineClosed("the engine shut down before this request finished"))
        for handle in list(self.workers.values()):
            if handle.conn is not None and not handle.stop_sent:
                handle.stop_sent = True
                self._send(handle, m.Stop())
        self._await_exits(time.monotonic() + timeout)
        self._running = False

    def _await_exits(self, deadline: float) -> None:
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

    def stats(self) -> EngineStats:
        now = time.monotonic()
        router = self.scheduler.router
        workers = []
        for slot in router.workers():
            h = self.workers[slot.worker_id]
            workers.append(
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
                    cpus=format_cpulist(h.applied[2]),
                )
            )
        return EngineStats(
            knobs=self.knobs,
            queue_depth=self.scheduler.queue_depth(),
            oldest_wait_seconds=self._oldest_wait(now),
            pending_requests=self.pending_requests(),
            ready_workers=sum(1 for w in workers if w.state == WorkerState.READY.value),
            workers=tuple(workers),
            counters=self.counters.copy(),
            crash_loop=self.crash_loop,
            placement=self.plan().as_dict(),
        )

    def _oldest_wait(self, now: float) -> float:
        oldest = self.scheduler.batcher.oldest_arrival()
        return 0.0 if oldest is None else max(0.0, now - oldest)

    # ---- workers: lifecycle ---------------------------------------------------------------

    def _reconcile(self, now: float) -> None:
        """Bring the number of active workers to process_count: fork, or drain the extra."""
        if self._closing:
            return
        if self.crash_loop is not None:
            return
        router = self.scheduler.router
        missing = self.knobs.process_count - len(router.active())
        if missing > 0 and now >= self._respawn_at:
            for _ in range(missing):
                self._fork(now)
        elif missing < 0:
            for worker_id in router.choose_to_retire(-missing):
                router.drain(worker_id)
                log.info("worker %d draining (process_count=%d)", worker_id, self.knobs.process_count)
        for worker_id in router.idle_draining():
            handle = self.workers[worker_id]
            if handle.ready_at is not None and not handle.stop_sent:
                self._send(handle, m.Stop())
                handle.stop_sent = True
        self._sync_workers()

    def _fork(self, now: float) -> None:
        worker_id = self._next_worker_id
        self._next_worker_id += 1
        handle = WorkerHandle(worker_id, forked_at=now)
        self.workers[worker_id] = handle
        self.scheduler.router.add(worker_id)
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
            threads=self.knobs.threads_per_process,
            max_batch_size=self.knobs.max_batch_size,
            slots=self.config.max_inflight_batches,
            slot_items=self.config.bounds.max_batch_size[1],
            max_length=self.info.max_length,
            hidden_size=self.info.hidden_size,
            eos_token_ids=self.info.eos_token_ids,
            warmup=self.config.warmup,
            pack_row_tokens=self.config.pack_row_tokens,
            vocab_size=self.info.vocab_size,
            cpus=handle.applied[2],
            numa_node=placement.node if placement is not None else None,
        )
        self.zygote.send(m.Fork(spec))

    # ---- workers: placement and live settings -------------------------------------------------

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

    def _desired(self, handle: WorkerHandle) -> tuple[int, int, tuple[int, ...]]:
        placement = self._placement_of(handle.worker_id)
        cpus = placement.cpus if placement is not None else handle.applied[2]
        return self.knobs.threads_per_process, self.knobs.max_batch_size, cpus

    def _sync_workers(self) -> None:
        """Send each live worker its threads, batch size and CPUs when they changed."""
        for handle in list(self.workers.values()):
            if handle.conn is None or handle.stop_sent:
                continue
            desired = self._desired(handle)
            if desired != handle.applied:
                handle.applied = desired
                self._send(handle, m.SetKnobs(*desired))

    def _on_zygote(self) -> None:
        try:
            msg = self.zygote.recv()
        except (EOFError, OSError):
            log.error("the zygote process died; no new workers can start")
            self._fail_everything(EngineClosed("the engine's zygote process died"))
            self._running = False
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
        if isinstance(msg, m.EmbedDone):
            self._on_embed_done(handle, msg)
        elif isinstance(msg, m.Tokens):
            self._on_tokens(handle, msg)
        elif isinstance(msg, m.Hello):
            if msg.shm_bytes:
                fd = recv_handle(handle.conn)
                c = self.config
                handle.shm = SlotBuffer(fd, c.max_inflight_batches, c.bounds.max_batch_size[1], self.info.max_length, self.info.hidden_size)
                handle.free_slots = list(range(c.max_inflight_batches))
        elif isinstance(msg, m.Ready):
            handle.ready_at = time.monotonic()
            self.scheduler.router.mark_ready(handle.worker_id)
            self._backoff = self.config.restart_backoff[0]
            log.info("worker %d (pid %d) ready after %.2fs warm-up", handle.worker_id, handle.pid, msg.warmup_seconds)
        elif isinstance(msg, m.WorkFailed):
            self._on_work_failed(handle, msg)
        else:
            log.error("worker %d sent an unknown message %s; refused", handle.worker_id, type(msg).__name__)

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
        self._recover(handle)
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
                self._fail_everything(EngineClosed(self.crash_loop))

    def _recover(self, handle: WorkerHandle) -> None:
        """Re-queue a dead worker's work: embeddings always, generations that had not started."""
        requeue: list[Item] = []
        for batch, _, _ in handle.batches.values():
            for item in batch.items:
                if self.config.task == "embed":
                    if item.request_id in self.embed_jobs:
                        requeue.append(item)
                    continue
                job = self.gen_jobs.get(item.request_id)
                if job is None:
                    continue
                if job.emitted == 0:
                    job.worker_id = job.batch_id = None
                    requeue.append(item)
                else:
                    del self.gen_jobs[item.request_id]
                    self.counters.failed += 1
                    job.stream.put(WorkerLost("the worker running this generation died after it had started streaming"))
        self.counters.requeued_items += len(requeue)
        self.scheduler.batcher.requeue(requeue)

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

    def _send(self, handle: WorkerHandle, msg) -> bool:
        try:
            handle.conn.send(msg)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._on_worker_exit(handle, "its connection broke")
            return False

    # ---- work: dispatch and results -------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        for dispatch in self.scheduler.schedule(now):
            handle = self.workers[dispatch.worker_id]
            if self.config.task == "embed":
                self._send_embed(handle, dispatch.batch, now)
            else:
                self._send_sequence(handle, dispatch.batch, now)

    def _send_embed(self, handle: WorkerHandle, batch: Batch, now: float) -> None:
        live = [item for item in batch.items if item.request_id in self.embed_jobs]
        if not live:
            self.scheduler.router.complete(handle.worker_id, batch.batch_id)
            return
        batch.items = live
        slot = handle.free_slots.pop()
        ids = handle.shm.ids(slot, len(live), batch.padded_length)
        ids.fill(self.info.pad_token_id)
        for row, item in enumerate(live):
            ids[row, : item.length] = item.payload
            job = self.embed_jobs[item.request_id]
            if job.first_dispatch is None:
                job.first_dispatch = now
        handle.batches[batch.batch_id] = (batch, slot, now)
        self.counters.batches += 1
        self.counters.items += len(live)
        rows, row_length = batch.shape(self.config.pack_row_tokens)
        self.counters.padded_tokens += rows * row_length
        self.counters.real_tokens += sum(item.length for item in live)
        self._send(handle, m.RunEmbed(batch.batch_id, slot, tuple(item.length for item in live)))

    def _send_sequence(self, handle: WorkerHandle, batch: Batch, now: float) -> None:
        (item,) = batch.items
        job = self.gen_jobs.get(item.request_id)
        if job is None:
            self.scheduler.router.complete(handle.worker_id, batch.batch_id)
            return
        job.worker_id, job.batch_id = handle.worker_id, batch.batch_id
        handle.batches[batch.batch_id] = (batch, -1, now)
        self.counters.batches += 1
        self.counters.items += 1
        self._send(handle, m.AddSequence(item.request_id, job.prompt_ids, job.params))

    def _on_embed_done(self, handle: WorkerHandle, msg: m.EmbedDone) -> None:
        batch, slot, _ = handle.batches.pop(msg.batch_id)
        out = handle.shm.out(slot, len(batch.items))
        now = time.monotonic()
        shape = (len(batch.items), *batch.shape(self.config.pack_row_tokens))
        for row, item in enumerate(batch.items):
            job = self.embed_jobs.get(item.request_id)
            if job is None:
                continue  # cancelled while it ran
            job.vectors[item.index] = out[row]
            if msg.model_seconds >= job.model_seconds:
                job.model_seconds, job.batch = msg.model_seconds, shape
            job.remaining -= 1
            if job.remaining == 0:
                del self.embed_jobs[item.request_id]
                self.counters.completed += 1
                job.future.set_result(self._embed_result(job, now))
        handle.free_slots.append(slot)
        size = len(batch.items)
        self.counters.batches_done += 1
        self.counters.model_seconds += msg.model_seconds
        self.counters.items_done += size
        self.counters.items_done_squared += size * size
        self.counters.item_model_seconds += size * msg.model_seconds
        self._finish_work(handle, msg.batch_id, size, msg.model_seconds)

    def _embed_result(self, job: EmbedJob, now: float) -> EmbedResult:
        timings = RequestTimings(
            preprocess=job.submitted - job.created,
            queue=(job.first_dispatch or now) - job.submitted,
            model=job.model_seconds,
            total=now - job.created,
            batch=job.batch,
        )
        for stage in ("preprocess", "queue", "model"):
            self.latency.record(stage, getattr(timings, stage))
        return EmbedResult(job.vectors, job.prompt_tokens, timings)

    def _on_tokens(self, handle: WorkerHandle, msg: m.Tokens) -> None:
        handle.busy_seconds += msg.model_seconds
        now = time.monotonic()
        for seq_id, token_id, finish, logprobs in msg.outputs:
            job = self.gen_jobs.get(seq_id)
            if job is None:
                continue
            self.latency.record("ttft" if job.emitted == 0 else "itl", now - (job.last_token_at or job.created))
            job.last_token_at = now
            job.emitted += 1
            self.counters.generated_tokens += 1
            if finish is not None:
                del self.gen_jobs[seq_id]
                self.counters.completed += 1
                handle.batches.pop(job.batch_id, None)
                self._finish_work(handle, job.batch_id, 1, 0.0)
            job.stream.put(TokenEvent(token_id, finish, logprobs))

    def _on_work_failed(self, handle: WorkerHandle, msg: m.WorkFailed) -> None:
        error = ModelFailed(f"the model failed on this input: {msg.error}")
        if self.config.task == "embed":
            batch, slot, _ = handle.batches.pop(msg.key)
            handle.free_slots.append(slot)
            for request_id in {item.request_id for item in batch.items}:
                job = self.embed_jobs.pop(request_id, None)
                if job is not None:
                    self.counters.failed += 1
                    job.future.set_exception(error)
            self._finish_work(handle, msg.key, len(batch.items), 0.0)
            return
        for seq_id in msg.sequences:
            job = self.gen_jobs.pop(seq_id, None)
            if job is not None:
                self.counters.failed += 1
                handle.batches.pop(job.batch_id, None)
                self.scheduler.router.complete(handle.worker_id, job.batch_id)
                job.stream.put(error)

    def _finish_work(self, handle: WorkerHandle, key: int, items: int, model_seconds: float) -> None:
        self.scheduler.router.complete(handle.worker_id, key)
        handle.busy_seconds += model_seconds
        handle.batches_done += 1
        handle.items_done += items

    # ---- endings ----------------------------------------------------------------------------

    def _fail_everything(self, error: Exception) -> None:
        for job in self.embed_jobs.values():
            if not job.future.done():
                job.future.set_exception(error)
        for job in self.gen_jobs.values():
            job.stream.put(error)
        self.counters.failed += len(self.embed_jobs) + len(self.gen_jobs)
        self.embed_jobs.clear()
        self.gen_jobs.clear()
        self.scheduler.batcher.clear()

    def _release_all(self) -> None:
        for handle in list(self.workers.values()):
            self._close_handle(handle)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
