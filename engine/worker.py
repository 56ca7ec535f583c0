"""A worker process: runs the model on batches the front process sends it.

Forked by the zygote (engine/zygote.py) with the model already in memory. The loop is boring
on purpose: receive a message, run it, answer. It exits when told to stop, when the front
process's socket closes, or (through PR_SET_PDEATHSIG) when the zygote dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

import torch

from engine import messages as m
from engine.config import kv_cap
from engine.numa_bind import apply_placement, pin_current_process
from engine.shm import SlotBuffer

log = logging.getLogger("selftune.worker")

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits, however it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_worker(spec: m.WorkerSpec, conn: Connection, model) -> int:
    die_with_parent()
    if spec.cpus:
        apply_placement(spec.cpus, spec.numa_node)
    torch.set_num_threads(spec.threads)
    if spec.device != "cpu":
        model.to(spec.device)
    try:
        if spec.task == "embed":
            return EmbedWorker(spec, conn, model).serve()
        return GenerateWorker(spec, conn, model).serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the front process went away: nothing left to serve


def apply_knobs(msg: m.SetKnobs) -> None:
    """Threads and CPUs; pinning first, so a grown OpenMP pool starts on the new CPUs."""
    if msg.cpus:
        pin_current_process(msg.cpus)
    torch.set_num_threads(msg.threads)


class EmbedWorker:
    def __init__(self, spec: m.WorkerSpec, conn: Connection, model):
        from engine.embedding import EmbeddingRunner
        from engine.onnx_embedding import OnnxEmbeddingRunner, OnnxGraph

        self.spec = spec
        self.conn = conn
        if isinstance(model, OnnxGraph):  # the zygote serves ONNX Runtime: this worker opens its own session
            self.runner = OnnxEmbeddingRunner(model.path, spec.threads)
        else:
            self.runner = EmbeddingRunner(model, spec.device, spec.pack_row_tokens, spec.vocab_size)
        self.shm = SlotBuffer.create(spec.slots, spec.slot_items, spec.max_length, spec.hidden_size)

    def serve(self) -> int:
        nbytes = SlotBuffer.nbytes(self.spec.slots, self.spec.slot_items, self.spec.max_length, self.spec.hidden_size)
        self.conn.send(m.Hello(self.spec.worker_id, os.getpid(), nbytes))
        send_handle(self.conn, self.shm.fd, 0)
        started = time.perf_counter()
        if self.spec.warmup:
            ids = self.shm.ids(0, 2, 8)
            ids[:] = 100
            self.runner.run(ids, (8, 8), self.shm.out(0, 2))  # equal lengths: warms the padded path only
        self.conn.send(m.Ready(time.perf_counter() - started))
        while True:
            msg = self.conn.recv()
            if isinstance(msg, m.RunEmbed):
                self.conn.send(self.run(msg))
            elif isinstance(msg, m.SetKnobs):
                apply_knobs(msg)
                self.runner.set_threads(msg.threads)
            elif isinstance(msg, m.Stop):
                return 0
            else:
                unknown(msg)

    def run(self, msg: m.RunEmbed):
        started = time.perf_counter()
        rows, length = len(msg.lengths), max(msg.lengths)
        try:
            self.runner.run(self.shm.ids(msg.slot, rows, length), msg.lengths, self.shm.out(msg.slot, rows))
        except Exception as exc:  # the batch fails, the worker lives on
            log.exception("embedding batch %d failed", msg.batch_id)
            return m.WorkFailed(msg.batch_id, f"{type(exc).__name__}: {exc}")
        return m.EmbedDone(msg.batch_id, msg.slot, time.perf_counter() - started)


class GenerateWorker:
    def __init__(self, spec: m.WorkerSpec, conn: Connection, model):
        from engine.generation import GenerationRunner

        self.spec = spec
        self.conn = conn
        self.runner = GenerationRunner(model, spec.eos_token_ids, spec.max_batch_size, kv_cap(spec.kv_knob, spec.kv_tokens),
                                       spec.max_batch_tokens or None, kv_ceiling=spec.kv_tokens)
        self.live: set[int] = set()

    def serve(self) -> int:
        self.conn.send(m.Hello(self.spec.worker_id, os.getpid(), 0))
        started = time.perf_counter()
        if self.spec.warmup:
            self._warm_up()
        self.conn.send(m.Ready(time.perf_counter() - started))
        while True:
            # Block only when idle; between decode steps take whatever has arrived.
            if not self.runner.has_work or self.conn.poll(0):
                if self.handle(self.conn.recv()):
                    return 0
                continue
            self.step()

    def _warm_up(self) -> None:
        from engine.generation import SamplingParams, SequenceRequest

        self.runner.add(SequenceRequest(-1, (1, 2, 3), SamplingParams(max_tokens=2, temperature=0)))
        while self.runner.has_work:
            self.runner.step()

    def handle(self, msg) -> bool:
        from engine.generation import SequenceRequest

        if isinstance(msg, m.AddSequence):
            self.runner.add(SequenceRequest(msg.seq_id, msg.prompt_ids, msg.params))
            self.live.add(msg.seq_id)
        elif isinstance(msg, m.AbortSequence):
            self.runner.abort(msg.seq_id)
            self.live.discard(msg.seq_id)
        elif isinstance(msg, m.SetKnobs):
            apply_knobs(msg)
            # Between steps, so no running sequence sees a half-changed runner.
            self.runner.max_running = msg.max_batch_size
            self.runner.prefill_chunk = msg.max_batch_tokens or None
            self.runner.kv_tokens = kv_cap(msg.kv_tokens, self.spec.kv_tokens)
        elif isinstance(msg, m.Stop):
            return True
        else:
            unknown(msg)
        return False

    def step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.runner.step()
        except Exception as exc:
            log.exception("decode step failed")
            doomed = self._abort_all()
            self.conn.send(m.WorkFailed(-1, f"{type(exc).__name__}: {exc}", doomed))
            return
        for o in outputs:
            if o.finish_reason is not None:
                self.live.discard(o.seq_id)
        if outputs:
            produced = tuple((o.seq_id, o.token_id, o.finish_reason, o.logprobs) for o in outputs)
            r = self.runner
            load = m.GenerationLoad(r.num_running, r.num_waiting, r.kv_tokens_used, r.kv_tokens or 0, r.preemptions,
                                    r.max_running, r.prefill_chunk or 0)
            self.conn.send(m.Tokens(produced, time.perf_counter() - started, load))

    def _abort_all(self) -> tuple[int, ...]:
        ids = tuple(self.live)
        for seq_id in ids:
            self.runner.abort(seq_id)
        self.live.clear()
        return ids


def unknown(msg) -> None:
    """A message outside the protocol is refused out loud, never dropped silently."""
    log.error("worker: refusing an unknown message %s (not in engine/messages.py's protocol)", type(msg).__name__)
