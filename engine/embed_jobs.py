"""EmbedJobs: embedding requests on their way through the workers (on the core thread).

A request's inputs are items; batches of items go to a worker through its shared-memory slot,
and the vectors come back there. A worker that dies re-runs nothing twice: its batches' items
go back to the queue (embeddings are idempotent).
"""

from __future__ import annotations

import time

from engine import messages as m
from engine.batcher import Batch, Item
from engine.jobs import EmbedJob, EmbedResult, ModelFailed, RequestTimings
from engine.supervisor import WorkerHandle
from engine.task_jobs import TaskJobs


class EmbedJobs(TaskJobs):
    result_type = m.EmbedDone

    def submit(self, job: EmbedJob, token_ids: list[list[int]]) -> None:
        self.jobs[job.request_id] = job
        self.counters.requests += 1
        for index, ids in enumerate(token_ids):
            self.scheduler.submit(Item(job.request_id, index, len(ids), job.submitted, ids))

    def send(self, handle: WorkerHandle, batch: Batch, now: float) -> None:
        live = [item for item in batch.items if item.request_id in self.jobs]
        if not live:
            self.scheduler.router.complete(handle.worker_id, batch.batch_id)
            return
        batch.items = live
        slot = handle.free_slots.pop()
        ids = handle.shm.ids(slot, len(live), batch.padded_length)
        ids.fill(self.info.pad_token_id)
        for row, item in enumerate(live):
            ids[row, : item.length] = item.payload
            job = self.jobs[item.request_id]
            if job.first_dispatch is None:
                job.first_dispatch = now
        handle.batches[batch.batch_id] = (batch, slot, now)
        self.counters.count_dispatch(batch, self.config.pack_row_tokens)
        self.supervisor.send(handle, m.RunEmbed(batch.batch_id, slot, tuple(item.length for item in live)))

    def on_result(self, handle: WorkerHandle, msg: m.EmbedDone) -> None:
        batch, slot, _ = handle.batches.pop(msg.batch_id)
        out = handle.shm.out(slot, len(batch.items))
        now = time.monotonic()
        shape = (len(batch.items), *batch.shape(self.config.pack_row_tokens))
        for row, item in enumerate(batch.items):
            job = self.jobs.get(item.request_id)
            if job is None:
                continue  # cancelled while it ran
            job.vectors[item.index] = out[row]
            if msg.model_seconds >= job.model_seconds:
                job.model_seconds, job.batch = msg.model_seconds, shape
            job.remaining -= 1
            if job.remaining == 0:
                del self.jobs[item.request_id]
                self.counters.completed += 1
                job.future.set_result(self._result(job, now))
        handle.free_slots.append(slot)
        self.counters.count_batch_done(len(batch.items), msg.model_seconds)
        self.supervisor.finish_work(handle, msg.batch_id, len(batch.items), msg.model_seconds)

    def _result(self, job: EmbedJob, now: float) -> EmbedResult:
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

    def on_failed(self, handle: WorkerHandle, msg: m.WorkFailed) -> None:
        error = ModelFailed(f"the model failed on this input: {msg.error}")
        batch, slot, _ = handle.batches.pop(msg.key)
        handle.free_slots.append(slot)
        for request_id in {item.request_id for item in batch.items}:
            job = self.jobs.pop(request_id, None)
            if job is not None:
                self.counters.failed += 1
                job.future.set_exception(error)
        self.supervisor.finish_work(handle, msg.key, len(batch.items), 0.0)

    def recover(self, handle: WorkerHandle) -> list[Item]:
        return [item for batch, _, _ in handle.batches.values() for item in batch.items if item.request_id in self.jobs]

    def shed(self, items: list[Item], now: float) -> None:
        for request_id in {item.request_id: None for item in items}:
            self.scheduler.batcher.cancel(request_id)  # its other inputs: the request has failed
            job = self.jobs.pop(request_id, None)
            if job is not None:
                self.counters.shed += 1
                job.future.set_exception(self.shed_error())

    def cancel(self, request_id: int) -> bool:
        self.scheduler.batcher.cancel(request_id)
        return self.jobs.pop(request_id, None) is not None

    def fail_all(self, error: Exception) -> None:
        for job in self.jobs.values():
            if not job.future.done():
                job.future.set_exception(error)
        self.counters.failed += len(self.jobs)
        self.jobs.clear()
