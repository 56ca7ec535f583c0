"""The engine with real worker processes and the real MiniLM model."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import minilm_dir
from helpers import alive, wait_until

from engine.config import EngineConfig, KnobError, Knobs
from engine.engine import Engine
from engine.jobs import EngineClosed, InputTooLong

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "selftune tunes itself while it serves",
    "a",
    "Embeddings map sentences to vectors; similar sentences land close together. " * 6,
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Batching stops paying at about sixteen short inputs on two cores.",
] + [f"sentence number {i} about topic {i % 7} " * (1 + i % 4) for i in range(42)]


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir(), device="cpu")
    return dict(zip(TEXTS, model.encode(TEXTS, batch_size=64)))


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(dtype="float32", knobs=Knobs(process_count=2, max_batch_size=8, batch_timeout=0.002))  # the exact fp32 path
    with Engine(config) as eng:
        yield eng


def test_embeddings_match_sentence_transformers(engine, reference):
    futures = [engine.embed(TEXTS[i : i + 3]) for i in range(0, len(TEXTS), 3)]
    results = [f.result(timeout=60) for f in futures]
    vectors = np.concatenate([r.vectors for r in results])
    expected = np.stack([reference[t] for t in TEXTS])
    assert vectors.shape == (len(TEXTS), 384)
    assert np.abs(vectors - expected).max() < 1e-4
    stats = engine.stats()
    assert stats.counters.batches < len(TEXTS)  # requests were batched together
    assert stats.counters.padded_tokens >= stats.counters.real_tokens


def test_bad_inputs_are_rejected_and_change_nothing(engine):
    before = engine.stats().counters.requests
    with pytest.raises(InputTooLong, match="at most 512"):
        engine.embed(["word " * 600]).result(timeout=30)
    with pytest.raises(ValueError):
        engine.embed([])
    with pytest.raises(KnobError, match="max_batch_size"):
        engine.apply(engine.knobs.replace(max_batch_size=0))
    assert engine.knobs.max_batch_size == 8
    assert engine.stats().counters.requests == before


def test_500_requests_while_knobs_change_all_answered_correctly(engine, reference):
    """process_count 1 -> 3 -> 1 and batch knobs every 100 ms, under load: nothing lost."""
    engine.apply(engine.knobs.replace(process_count=1))
    stop = threading.Event()
    seen_counts = set()

    def retune():
        schedule = [1] * 3 + [3] * 12 + [1] * 100
        for step, count in enumerate(schedule):
            if stop.is_set():
                return
            knobs = engine.knobs.replace(
                process_count=count,
                max_batch_size=[1, 4, 16, 32][step % 4],
                batch_timeout=[0.0, 0.001, 0.01][step % 3],
            )
            engine.apply(knobs)
            seen_counts.add(len([w for w in engine.stats().workers if w.state != "draining"]))
            stop.wait(0.1)

    tuner = threading.Thread(target=retune)
    tuner.start()
    futures = []
    for i in range(500):
        texts = [TEXTS[(i * 7 + j) % len(TEXTS)] for j in range(1 + i % 3)]
        futures.append((texts, engine.embed(texts)))
        time.sleep(0.004)
    try:
        for texts, future in futures:
            vectors = future.result(timeout=120).vectors
            expected = np.stack([reference[t] for t in texts])
            assert np.abs(vectors - expected).max() < 1e-4
    finally:
        stop.set()
        tuner.join()
    stats = engine.stats()
    assert 3 in seen_counts
    assert stats.counters.failed == 0
    assert stats.counters.worker_deaths == 0
    wait_until(lambda: len(engine.stats().workers) == 1)


def test_the_arrival_that_fills_a_batch_sends_it_without_waiting_for_the_timer(engine, reference):
    """Arrivals after the first skip the core's wake-up while a batch timer is due anyway; the one
    that fills the batch must still wake it, so four requests go as one batch at once, not at 30 s."""
    knobs = engine.knobs
    core = engine._core  # past the knobs' bounds (1 s at most): a timer no test would wait for
    core.call(core.set_knobs, knobs.replace(max_batch_size=4, batch_timeout=30.0)).result()
    before = engine.stats().counters
    try:
        futures = [engine.embed([text]) for text in TEXTS[:4]]
        vectors = np.concatenate([future.result(timeout=10).vectors for future in futures])
    finally:
        engine.apply(knobs)
    after = engine.stats().counters
    assert np.abs(vectors - np.stack([reference[t] for t in TEXTS[:4]])).max() < 1e-4
    assert (after.batches - before.batches, after.items - before.items) == (1, 4)


def test_a_request_of_64_inputs_runs_in_many_batches_on_both_workers_and_comes_back_in_order(engine):
    """Indexing clients send 32-256 texts per request: its inputs are items of their own, so
    they spread over batches and workers; the batcher groups them by length, which reorders
    them, and each vector still lands at its input's place."""
    engine.apply(engine.knobs.replace(process_count=2, threads_per_process=1, max_batch_size=8, batch_timeout=0.002))  # earlier tests move them
    engine.wait_ready(workers=2)
    texts = [f"document {i}: " + "words of the indexed page " * (1 + (i * 7) % 11) for i in range(64)]
    singles = np.concatenate([engine.embed(t).result(timeout=60).vectors for t in texts])
    before = engine.stats()
    result = engine.embed(texts).result(timeout=120)
    after = engine.stats()
    batches = after.counters.batches - before.counters.batches
    assert batches >= 64 // engine.knobs.max_batch_size  # batches of at most max_batch_size items
    assert after.counters.items - before.counters.items == 64
    items = {w.worker_id: w.items for w in before.workers}
    ran = {w.worker_id: w.items - items.get(w.worker_id, 0) for w in after.workers}
    assert len(ran) == 2 and all(n > 0 for n in ran.values()) and sum(ran.values()) == 64, ran
    assert result.vectors.shape == (64, 384)
    assert np.abs(result.vectors - singles).max() < 1e-5  # in order, and equal to one-input requests


def test_killed_worker_loses_no_embedding_request(engine, reference):
    engine.apply(engine.knobs.replace(process_count=2, max_batch_size=4, batch_timeout=0.0))
    engine.wait_ready(workers=2)
    deaths = engine.stats().counters.worker_deaths
    victim = engine.stats().workers[0].pid
    futures = [(TEXTS[i % len(TEXTS)], engine.embed(TEXTS[i % len(TEXTS)])) for i in range(300)]
    wait_until(lambda: engine.stats().counters.completed > 20)
    os.kill(victim, signal.SIGKILL)
    for text, future in futures:
        assert np.abs(future.result(timeout=120).vectors[0] - reference[text]).max() < 1e-4
    stats = engine.stats()
    assert stats.counters.worker_deaths == deaths + 1
    assert victim not in [w.pid for w in stats.workers]
    engine.wait_ready(workers=2, timeout=60)  # a replacement took its place


def test_shutdown_leaves_no_process_and_no_shared_memory(shm_entries):
    eng = Engine(EngineConfig(knobs=Knobs(process_count=3))).start()
    eng.wait_ready(workers=3)
    pids = eng.pids
    everything = pids["zygote"] + pids["workers"]
    assert len(pids["workers"]) == 3 and all(alive(p) for p in everything)
    eng.embed(TEXTS).result(timeout=60)
    os.kill(pids["workers"][1], signal.SIGKILL)  # a dead worker must not leak either
    eng.shutdown()
    assert not [p for p in everything if alive(p)]
    assert set(os.listdir("/dev/shm")) == shm_entries
    core = eng._core  # a call that reaches the core after its loop ended is refused, not left waiting
    assert isinstance(core.call(core.stats).exception(timeout=5), EngineClosed)
    assert isinstance(core.call(core.submit_embed, None, [[1]], defer_items=1).exception(timeout=5), EngineClosed)


def test_waiting_for_workers_ends_at_once_in_a_crash_loop():
    """A crash loop means no worker will come: wait_ready says so instead of running out its timeout."""
    with Engine(EngineConfig(knobs=Knobs(process_count=1), crash_loop=(1, 60.0))) as eng:
        eng.wait_ready(workers=1)
        os.kill(eng.pids["workers"][0], signal.SIGKILL)
        wait_until(lambda: eng.stats().crash_loop is not None, timeout=30)
        with pytest.raises(RuntimeError, match="crash loop"):
            eng.wait_ready(workers=1, timeout=600)  # before, this waited out the 600 s


def test_front_process_death_takes_the_workers_with_it(tmp_path):
    """SIGKILL of the process that owns the engine: the zygote and workers exit by themselves."""
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(
        "import sys\n"
        "from engine.engine import Engine\n"
        "from engine.config import EngineConfig, Knobs\n"
        "eng = Engine(EngineConfig(knobs=Knobs(process_count=2))).start()\n"
        "eng.wait_ready(workers=2)\n"
        "p = eng.pids\n"
        "print(' '.join(map(str, p['zygote'] + p['workers'])), flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 3
    owner.kill()
    owner.wait()
    wait_until(lambda: not [p for p in pids if alive(p)], timeout=5)


def os_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def test_threads_per_process_changes_live_in_every_worker(engine):
    """A control message resizes each worker's torch pool: its OpenMP threads appear."""
    engine.apply(engine.knobs.replace(process_count=2, threads_per_process=1))
    engine.wait_ready(workers=2)
    engine.embed(TEXTS).result(timeout=60)
    before = {w.pid: os_threads(w.pid) for w in engine.stats().workers}
    engine.apply(engine.knobs.replace(threads_per_process=2))
    for _ in range(4):  # enough batches that every worker runs one with the new pool
        engine.embed(TEXTS).result(timeout=60)
    after = {w.pid: os_threads(w.pid) for w in engine.stats().workers}
    assert before.keys() == after.keys()
    assert all(after[pid] > before[pid] for pid in before), (before, after)
    engine.apply(engine.knobs.replace(threads_per_process=1))


def test_token_ids_match_transformers_and_never_truncate():
    """token_ids calls the Rust backend directly; the ids must be transformers' own, and a
    fresh tokenizer (whose backend comes with truncation at 128 set) must not cut a long text."""
    from engine.loading import load_tokenizer, token_ids

    tokenizer = load_tokenizer(minilm_dir())
    long_text = "word " * 600
    first = token_ids(tokenizer, [long_text])  # the backend still has its saved truncation here
    assert len(first[0]) == 602
    texts = TEXTS + [long_text, "héllo wörld [SEP] [MASK] 😀", " leading space", "tabs\tand\nnewlines"]
    expected = tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    assert tokenizer.backend_tokenizer.truncation is None  # cleared by transformers' call: the backend path from here on
    assert token_ids(tokenizer, texts) == expected
    assert [token_ids(tokenizer, [t])[0] for t in texts] == expected
