"""GenerateJobs: generations on their way through the workers (on the core thread).

Each generation is one sequence that joins a worker's running batch; its tokens stream back
one message per decode step. A worker that dies re-runs only the generations that had not
streamed a token yet; the others end with WorkerLost.
"""

from __future__ import annotations

import time

from engine import messages as m
from engine.batcher import Batch, Item
from engine.jobs import GenerateJob, ModelFailed, TokenEvent, WorkerLost
from engine.supervisor import WorkerHandle
from engine.task_jobs import TaskJobs


class GenerateJobs(TaskJobs):
    result_type = m.Tokens

    def submit(self, job: GenerateJob) -> None:
        self.jobs[job.request_id] = job
        self.counters.requests += 1
        self.scheduler.submit(job.item)

    def send(self, handle: WorkerHandle, batch: Batch, now: float) -> None:
        (item,) = batch.items
        job = self.jobs.get(item.request_id)
        if job is None:
            self.scheduler.router.complete(handle.worker_id, batch.batch_id)
            return
        job.worker_id, job.batch_id = handle.worker_id, batch.batch_id
        handle.batches[batch.batch_id] = (batch, -1, now)
        self.counters.batches += 1
        self.counters.items += 1
        self.counters.real_tokens += len(job.prompt_ids)  # prompt tokens: the generation policy reads their rate
        self.supervisor.send(handle, m.AddSequence(item.request_id, job.prompt_ids, job.params))

    def on_result(self, handle: WorkerHandle, msg: m.Tokens) -> None:
        handle.busy_seconds += msg.model_seconds
        handle.generation = msg.load
        now = time.monotonic()
        for seq_id, token_id, finish, logprobs in msg.outputs:
            job = self.jobs.get(seq_id)
            if job is None:
                continue
            self.latency.record("ttft" if job.emitted == 0 else "itl", now - (job.last_token_at or job.created))
            job.first_token_at = job.first_token_at or now
            job.last_token_at = now
            job.emitted += 1
            self.counters.generated_tokens += 1
            if finish is not None:
                if job.emitted > 1:  # time per output token: the request's mean gap, what goodput judges it by
                    self.latency.record("tpot", (now - job.first_token_at) / (job.emitted - 1))
                del self.jobs[seq_id]
                self.counters.completed += 1
                handle.batches.pop(job.batch_id, None)
                self.supervisor.finish_work(handle, job.batch_id, 1, 0.0)
            job.stream.put(TokenEvent(token_id, finish, logprobs))

    def on_failed(self, handle: WorkerHandle, msg: m.WorkFailed) -> None:
        error = ModelFailed(f"the model failed on this input: {msg.error}")
        for seq_id in msg.sequences:
            job = self.jobs.pop(seq_id, None)
            if job is not None:
                self.counters.failed += 1
                handle.batches.pop(job.batch_id, None)
                self.scheduler.router.complete(handle.worker_id, job.batch_id)
                job.stream.put(error)

    def recover(self, handle: WorkerHandle) -> list[Item]:
        requeue: list[Item] = []
        for batch, _, _ in handle.batches.values():
            for item in batch.items:
                job = self.jobs.get(item.request_id)
                if job is None:
                    continue
                if job.emitted == 0:
                    job.worker_id = job.batch_id = None
                    requeue.append(item)
                else:
                    del self.jobs[item.request_id]
                    self.counters.failed += 1
                    job.stream.put(WorkerLost("the worker running this generation died after it had started streaming"))
        return requeue

    def shed(self, items: list[Item], now: float) -> None:
        for item in items:
            job = self.jobs.pop(item.request_id, None)
            if job is not None:
                self.counters.shed += 1
                # its first token would have come after at least this wait: TTFT's histogram counts it (the policy also counts it refused)
                self.latency.record("ttft", now - job.created)
                job.stream.put(self.shed_error())

    def cancel(self, request_id: int) -> bool:
        """Also stops the generation on its worker, which frees its place there."""
        self.scheduler.batcher.cancel(request_id)
        job = self.jobs.pop(request_id, None)
        if job is None:
            return False
        if job.worker_id is not None:
            handle = self.supervisor.workers.get(job.worker_id)
            self.scheduler.router.complete(job.worker_id, job.batch_id)
            if handle is not None and handle.conn is not None:
                handle.batches.pop(job.batch_id, None)
                self.supervisor.send(handle, m.AbortSequence(request_id))
        return True

    def fail_all(self, error: Exception) -> None:
        for job in self.jobs.values():
            job.stream.put(error)
        self.counters.failed += len(self.jobs)
        self.jobs.clear()
