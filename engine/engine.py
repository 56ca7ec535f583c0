"""Engine: the public face of the serving engine, `apply(knobs)` and `stats()` among it.

It owns every resource the engine has: the zygote process, the core thread and the I/O pool;
`shutdown()` releases them all, and runs even when start-up failed half-way. Callers (the HTTP
server, the benchmarks, the tests) use `embed`, `generate`, `apply`, `stats` and `cancel`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection

import numpy as np

from engine import messages as m
from engine.batcher import Item
from engine.config import CPU_BATCH_TOKENS_PER_THREAD, EngineConfig, Knobs, kv_token_slots
from engine.core import EngineCore
from engine.io_pool import IOPool
from engine.jobs import EmbedJob, EngineClosed, GenerateJob, InputTooLong, TokenStream
from engine.lifecycle import EngineState
from engine.loading import ModelInfo, load_tokenizer, model_info, token_ids
from engine.model_source import ModelSource, resolve_model
from engine.sampling import SamplingParams
from engine.stats import EngineStats, LatencyHistograms

log = logging.getLogger("selftune.engine")


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.knobs = config.bounds.validate(config.knobs)
        self.source: ModelSource | None = None
        self.tokenizer = None
        self.info: ModelInfo | None = None
        self.device = None
        self.dtype = None
        self.dtype_choice: dict | None = None
        """How model.dtype was resolved (the zygote's probe), for /stats and /metrics."""
        self.batch_tokens_choice: dict | None = None
        """How `max_batch_tokens: auto` was measured (engine.gen_chunk), for /stats; None if it was not."""
        self._zygote_proc: subprocess.Popen | None = None
        self._zygote_conn: Connection | None = None
        self._core: EngineCore | None = None
        self._core_thread: threading.Thread | None = None
        self._pool: IOPool | None = None
        self._ids = itertools.count(1)
        self._apply_lock = threading.Lock()
        self.state = EngineState.CREATED
        self.latency = LatencyHistograms()
        """Per-stage latency of finished requests; the monitors read windows of it."""

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, ready_timeout: float = 300.0) -> "Engine":
        self.state = EngineState.STARTING
        try:
            self._start(ready_timeout)
        except BaseException:
            self.shutdown(grace=0)
            raise
        self.state = EngineState.SERVING
        return self

    def _start(self, ready_timeout: float) -> None:
        self.source = resolve_model(self.config.model, self.config.cache_dir)
        self.tokenizer = load_tokenizer(self.source.path)
        self.info = model_info(self.source.path, self.tokenizer, self.config.task)
        self._start_zygote(ready_timeout)
        if self.config.task == "generate":
            slots = kv_token_slots(self.config.kv_cache_mib, self.info.kv_values_per_token, self.dtype)
            self.info = dataclasses.replace(self.info, kv_tokens=slots)
            log.info("KV cache: %s token slots per worker (model.kv_cache_mib %d at %s)", slots, self.config.kv_cache_mib, self.dtype)
        self._pool = IOPool(self.knobs.io_threads)
        self._core = EngineCore(self.config, self.info, self._zygote_conn, self.device, self.knobs, self.latency)
        self._core_thread = threading.Thread(target=self._core.run, name="selftune-core", daemon=True)
        self._core_thread.start()
        self.wait_ready(ready_timeout)

    def _start_zygote(self, timeout: float) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        c = self.config
        batch_tokens = str(CPU_BATCH_TOKENS_PER_THREAD) if c.measure_batch_tokens else "fixed"  # measured: the constant is the fallback
        args = [str(theirs.fileno()), self.source.path, c.task, c.device, c.dtype, c.backend, c.cache_dir, batch_tokens]
        # One BLAS/OpenMP thread in the zygote: it never computes, and its pools must not
        # outlive the fork; each worker sets its own thread count.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        # GPUs: the planner numbers them as NVML does (PCI bus order), so CUDA must too; and
        # torch's "is CUDA there" asks NVML, not the runtime, so the zygote's check does not
        # initialise CUDA in the process its workers fork from (a forked child could not use it).
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        self._zygote_proc = subprocess.Popen(
            [sys.executable, "-m", "engine.zygote", *args], pass_fds=[theirs.fileno()], close_fds=True, env=env
        )
        theirs.close()
        self._zygote_conn = Connection(ours.detach())
        if not self._zygote_conn.poll(timeout):
            raise RuntimeError(f"the model did not load within {timeout:.0f}s")
        msg = self._zygote_conn.recv()
        if isinstance(msg, m.ZygoteFailed):
            raise RuntimeError(f"loading {self.config.model} failed:\n{msg.error}")
        self.device, self.dtype, self.dtype_choice = msg.device, msg.dtype, msg.dtype_choice
        if msg.batch_tokens_choice is not None:  # before any worker exists: they all start at the measured chunk
            self.batch_tokens_choice = msg.batch_tokens_choice
            tokens = msg.batch_tokens_choice["per_thread"] * max(1, self.knobs.threads_per_process)
            self.knobs = c.bounds.clamp(self.knobs.replace(max_batch_tokens=tokens))

    def wait_ready(self, timeout: float = 300.0, workers: int = 1) -> None:
        """Block until at least `workers` workers have warmed up and take traffic."""
        if self._core.wait_for(lambda core: core.ready_workers >= workers or core.crash_loop is not None, timeout):
            if self._core.ready_workers >= workers:
                return
            raise RuntimeError(f"no {workers} ready worker(s): {self._core.crash_loop}")
        if self._core.state is EngineState.STOPPED:
            raise RuntimeError("the engine core stopped during start-up; see the log")
        raise TimeoutError(f"no {workers} ready worker(s) after {timeout:.0f}s")

    def shutdown(self, grace: float = 30.0) -> None:
        """Finish what is queued or running (up to `grace` seconds), then stop everything."""
        if self.state in (EngineState.CLOSING, EngineState.STOPPED):
            return
        self.state = EngineState.CLOSING
        core_alive = self._core_thread is not None and self._core_thread.is_alive()
        if core_alive:
            self._core.call(self._core.begin_close).result()
            self._core.wait_for(lambda core: core.pending == 0, grace)
            self._core.call(self._core.stop).result()
            self._core_thread.join(timeout=30)
        self._stop_zygote()
        if self._pool is not None:
            self._pool.shutdown()
        self.state = EngineState.STOPPED

    def _stop_zygote(self) -> None:
        if self._zygote_conn is not None:
            try:
                self._zygote_conn.send(m.Stop())
            except OSError:
                pass
            self._zygote_conn.close()
        if self._zygote_proc is not None:
            try:
                self._zygote_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._zygote_proc.kill()
                self._zygote_proc.wait()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- knobs and stats -------------------------------------------------------------------

    def apply(self, knobs: Knobs) -> Knobs:
        """Change the running engine's knobs; raises KnobError (and changes nothing) if invalid."""
        knobs = self.config.bounds.validate(knobs)
        with self._apply_lock:
            self._pool.resize(knobs.io_threads)
            self._core.call(self._core.set_knobs, knobs).result()
            self.knobs = knobs
        return knobs

    def stats(self) -> EngineStats:
        return self._core.call(self._core.stats).result(timeout=10)

    @property
    def pids(self) -> dict[str, list[int]]:
        """Every process the engine runs, for tests and memory accounting."""
        workers = [w.pid for w in self.stats().workers if w.pid is not None]
        zygote = [self._zygote_proc.pid] if self._zygote_proc else []
        return {"zygote": zygote, "workers": workers}

    # ---- requests ------------------------------------------------------------------------

    def embed(self, texts: list[str] | str) -> Future:
        """Future of an EmbedResult; tokenization runs on the I/O pool (inline if io_threads=0)."""
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            raise ValueError("embed needs at least one input")
        self._check_open()
        future: Future = Future()
        created = time.monotonic()
        self._pool.submit(self._tokenize_and_submit, list(texts), future, created)
        return future

    def embed_tokens(self, token_ids: list[list[int]]) -> Future:
        """Like `embed`, for inputs that are already token ids (each must fit the model)."""
        self._check_open()
        future: Future = Future()
        self._submit_embed(token_ids, future, time.monotonic())
        return future

    def _tokenize_and_submit(self, texts: list[str], future: Future, created: float) -> None:
        try:
            self._submit_embed(token_ids(self.tokenizer, texts), future, created)
        except Exception as exc:
            future.set_exception(exc)

    def _submit_embed(self, token_ids: list[list[int]], future: Future, created: float) -> None:
        self.check_tokens(token_ids)
        request_id = next(self._ids)
        job = EmbedJob(
            request_id=request_id,
            future=future,
            vectors=np.empty((len(token_ids), self.info.hidden_size), dtype=np.float32),
            remaining=len(token_ids),
            prompt_tokens=sum(len(ids) for ids in token_ids),
            created=created,
            submitted=time.monotonic(),
        )
        future.request_id = request_id
        self._core.call(self._core.submit_embed, job, token_ids, defer_items=len(token_ids)).add_done_callback(
            lambda f: f.exception() and future.set_exception(f.exception())
        )

    def check_tokens(self, token_ids: list[list[int]]) -> None:
        """Reject inputs the model cannot take: empty, too long, or ids outside its vocabulary."""
        limit = self.max_input_tokens
        vocab = self.info.vocab_size
        for index, ids in enumerate(token_ids):
            if len(ids) > limit:
                raise InputTooLong(f"input {index} has {len(ids)} tokens; this model accepts at most {limit}")
            if not ids:
                raise ValueError(f"input {index} is empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {index} has token ids outside the vocabulary [0, {vocab})")

    def check_generation(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject a generation that cannot fit the model, whatever the load, or that names
        token ids outside its vocabulary (they would index past the logits in the worker)."""
        self.check_tokens([prompt_ids])
        if len(prompt_ids) + params.max_tokens > self.info.max_length:
            raise InputTooLong(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of {self.info.max_length}"
            )
        slots = self.info.kv_tokens
        if slots is not None and len(prompt_ids) + params.max_tokens > slots:
            raise InputTooLong(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs more KV cache than a worker has "
                f"({slots} tokens: model.kv_cache_mib {self.config.kv_cache_mib})"
            )
        vocab = self.info.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {vocab})")

    @property
    def max_input_tokens(self) -> int:
        return min(self.config.max_input_tokens or self.info.max_length, self.info.max_length)

    def generate(self, prompt: str | list[int], params: SamplingParams = SamplingParams(), on_event=None) -> TokenStream:
        """Start a generation; the stream yields TokenEvents as the worker makes them.

        `on_event`, if given, receives every event instead (on the engine's thread; keep it
        short, e.g. hand the event to an event loop).
        """
        self._check_open()
        prompt_ids = self.prompt_ids(prompt)
        self.check_generation(prompt_ids, params)
        request_id = next(self._ids)
        stream = TokenStream(request_id, len(prompt_ids))
        stream.on_event = on_event
        now = time.monotonic()
        item = Item(request_id, 0, len(prompt_ids), now, None)
        job = GenerateJob(request_id, item, stream, now, prompt_ids=tuple(prompt_ids), params=params)
        self._core.call(self._core.submit_generate, job).result()
        return stream

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A generation prompt's token ids: a text is tokenized, ids are taken as they are."""
        return token_ids(self.tokenizer, [prompt])[0] if isinstance(prompt, str) else list(prompt)

    def run_io(self, fn, *args) -> Future:
        """Run post-processing (response shaping) on the I/O pool."""
        return self._pool.submit(fn, *args)

    def cancel(self, request_id: int) -> bool:
        """Drop a request: its queued work goes, its generation stops. Idempotent."""
        if self._core is None or not self._core_thread.is_alive():
            return False
        return self._core.call(self._core.cancel, request_id).result()

    def _check_open(self) -> None:
        if self.state is not EngineState.SERVING:
            raise EngineClosed("the engine is not running")
