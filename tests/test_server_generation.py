"""Text generation through the real server: the `openai` package, plain and streamed."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from autotune.bench.server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {
        "model": {"name": "builtin:smollm2", "task": "generate"},
        "concurrency": {"process_count": 1, "threads_per_process": 2, "max_batch_size": 4},
        "limits": {"request_timeout_seconds": 3, "max_queued_tokens": 5000},
    }
    srv = ServerProcess(tmp_path_factory.mktemp("gen-server"), config, ready_timeout=300)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    answer = response.choices[0].message.content
    assert "Paris" in answer
    assert response.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in answer
    assert response.usage.completion_tokens <= 24 and response.usage.prompt_tokens > 5


def test_chat_streamed_equals_chat_whole(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_plain_streamed_and_max_tokens(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_string_ends_the_text_before_it(client):
    prompt = "Count: one, two, three, four, five, six,"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = free.strip().split()[1][:3]  # a few characters from the middle of the free answer
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    assert free.startswith(cut.choices[0].text)


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_deadline_gives_504_and_drops_the_work(server):
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    stats = httpx.get(server.url + "/stats").json()
    assert stats["pending_requests"] == 0 and stats["workers"][0]["load"] == 0


def test_client_disconnect_stops_the_generation(server):
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # one token arrived; now hang up
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/stats").json()["pending_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = httpx.get(server.url + "/stats").json()
    assert stats["pending_requests"] == 0
    assert stats["counters"]["cancelled"] >= 1


def test_generation_errors_are_4xx(server):
    cases = [
        ({"model": MODEL, "prompt": ""}, 400),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400),
        ({"model": MODEL, "prompt": [1, 2, 10**8]}, 400),
        ({"model": "nope", "prompt": "hi"}, 404),
    ]
    for body, status in cases:
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == status, (body, response.text)
    bad_chat = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert bad_chat.status_code == 400
    embed = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert embed.status_code == 400
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_queued_tokens_are_bounded_with_429(server):
    """Two long generations fill the 5000-token budget; a third waits its turn (429)."""
    long = {"model": MODEL, "prompt": COUNTING, "max_tokens": 2400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=60) as a, httpx.stream(
        "POST", server.url + "/v1/completions", json=long, timeout=60
    ) as b:
        lines_a, lines_b = a.iter_lines(), b.iter_lines()  # kept: a dropped iterator closes its stream
        next(lines_a)
        next(lines_b)
        response = httpx.post(server.url + "/v1/completions", json={**long, "stream": False}, timeout=30)
        assert response.status_code == 429 and response.headers["retry-after"]
        assert "5000 tokens" in response.json()["error"]["message"]
    never = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 6000}, timeout=30)
    assert never.status_code == 400 and "max_tokens" in never.json()["error"]["message"]
    stats = httpx.get(server.url + "/stats").json()
    assert stats["server"]["in_flight"] == 0 and stats["pending_requests"] == 0
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200
