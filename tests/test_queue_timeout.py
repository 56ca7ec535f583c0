"""limits.queue_timeout_seconds on real servers: a request that waits its limit for a worker is
refused with a 429 before it runs (streamed or not, generation or embeddings), the work already on
a worker finishes, and the server goes on serving. A worker held with SIGSTOP makes the queue."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import openai
import pytest
from conftest import minilm_dir
from helpers import wait_until

from autotune.bench.server import ServerProcess
from engine.config import EngineConfig, Knobs
from engine.engine import Engine
from engine.jobs import QueueTimeout


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_causal_lm):
    config = {
        "model": {"name": tiny_causal_lm, "task": "generate", "dtype": "float32", "served_names": ["tiny"]},
        # one running sequence on one worker, knobs held: the second request waits in the front's queue
        "concurrency": {"process_count": 1, "threads_per_process": 1, "max_batch_size": 1},
        "autotune": {"enabled": False},
        "limits": {"queue_timeout_seconds": 1.0, "request_timeout_seconds": 30, "retry_after_seconds": 3},
    }
    srv = ServerProcess(tmp_path_factory.mktemp("queue-timeout"), config, ready_timeout=120)
    yield srv
    assert srv.stop() == 0, srv.log()


def _stats(server) -> dict:
    return httpx.get(server.url + "/stats", timeout=10).json()


def test_a_generation_that_waits_its_limit_is_refused_with_429_streamed_or_not(server):
    worker = _stats(server)["workers"][0]["pid"]
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    held: dict = {}
    os.kill(worker, signal.SIGSTOP)
    try:
        first = threading.Thread(target=lambda: held.update(response=httpx.post(server.url + "/v1/completions", json=body, timeout=30)))
        first.start()
        wait_until(lambda: _stats(server)["workers"][0]["load"] == 1)  # on the stopped worker: it holds the only place
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as refused:  # a stream is refused before it starts: a 429, not a 200 with an error event
            client.completions.create(model="tiny", prompt="four five", max_tokens=5, stream=True)
        assert refused.value.body["code"] == "queue_timeout"
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert whole.status_code == 429 and whole.headers["retry-after"] == "3"  # limits.retry_after_seconds, as the admission's 429
        assert "queue_timeout_seconds" in whole.json()["error"]["message"]
    finally:
        os.kill(worker, signal.SIGCONT)
    first.join(30)
    assert held["response"].status_code == 200 and held["response"].json()["usage"]["completion_tokens"] == 5
    stats = _stats(server)
    assert stats["counters"]["shed"] == 2 and stats["server"]["queue_timeout_seconds"] == 1.0
    assert stats["pending_requests"] == 0 and stats["server"]["in_flight"] == 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'selftune_requests_total{outcome="shed"} 2.0' in metrics
    assert 'selftune_requests_total{outcome="rejected"} 0.0' in metrics  # the admission's 429s only: a shed request is counted once
    again = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    assert again.status_code == 200 and again.text.rstrip().endswith("data: [DONE]")


def test_queued_embeddings_past_their_limit_fail_whole_and_the_engine_goes_on():
    config = EngineConfig(model=minilm_dir(), task="embed", dtype="float32", backend="torch", queue_timeout=0.5,
                          knobs=Knobs(process_count=1, threads_per_process=1, io_threads=0, max_batch_size=2, batch_timeout=0.0))
    with Engine(config) as engine:
        worker = engine.stats().workers[0].pid
        os.kill(worker, signal.SIGSTOP)
        try:
            running = engine.embed(["held on the stopped worker", "and its neighbour"])
            wait_until(lambda: engine.stats().queue_depth == 0)
            late = engine.embed(["a", "request", "of", "five", "inputs"])  # none of them reaches the worker: the request fails whole
            with pytest.raises(QueueTimeout):
                late.result(timeout=10)
            assert engine.stats().queue_depth == 0 and engine.stats().counters.shed == 1
        finally:
            os.kill(worker, signal.SIGCONT)
        assert running.result(timeout=30).vectors.shape[0] == 2
        assert engine.embed(["after"]).result(timeout=30).vectors.shape[0] == 1
        assert engine.stats().pending_requests == 0
