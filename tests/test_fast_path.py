"""EmbeddingsFastPath at the ASGI level, with a real engine: what it answers itself, what it
hands on to the app behind it (here a recorder standing where FastAPI stands), byte for byte."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from engine.config import EngineConfig, Knobs
from engine.engine import Engine
from engine.http.fast_path import EmbeddingsFastPath
from engine.http.state import ServerLimits, ServerState

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(knobs=Knobs(process_count=1, max_batch_size=8, batch_timeout=0.001))) as eng:
        yield eng


class Behind:
    """The app behind the fast path: records what reached it and answers 418."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.bodies.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def call(app, body: bytes, path="/v1/embeddings", method="POST", content_type=b"application/json", length=True, pieces=1):
    """One request through `app`; (status, headers, body) of its response."""
    headers = [(b"content-type", content_type)] + ([(b"content-length", str(len(body)).encode())] if length else [])
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b"", "root_path": ""}
    size = -(-len(body) // pieces) or 1
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays until the answer (a disconnect never comes)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def request(**fields) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def test_a_valid_request_is_answered_without_the_app_behind(engine):
    behind = Behind()
    app = EmbeddingsFastPath(behind, ServerState(engine, ServerLimits()))
    texts = ["hello world", "the fast path"]
    status, headers, body = call(app, request(input=texts, encoding_format="base64"), pieces=3)
    assert status == 200 and behind.bodies == []
    data = json.loads(body)
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data["data"]])
    expected = engine.embed(texts).result(timeout=60).vectors
    assert np.abs(got - expected).max() < 1e-5
    assert data["usage"]["prompt_tokens"] > len(texts) and float(headers[b"x-selftune-model-ms"]) > 0
    status, _, body = call(app, request(input="one text"), content_type=b"application/json; charset=utf-8")
    assert status == 200 and len(json.loads(body)["data"][0]["embedding"]) == 384 and behind.bodies == []


def test_unknown_fields_are_answered_by_the_fast_path_and_named_safely_in_a_header(engine):
    behind = Behind()
    app = EmbeddingsFastPath(behind, ServerState(engine, ServerLimits()))
    status, headers, _ = call(app, request(input="a", temperature=1, priority=2))
    assert status == 200 and behind.bodies == [] and headers[b"x-selftune-ignored-fields"] == b"priority,temperature"
    # keys no header can carry (not latin-1, control characters, commas) are counted, not shown
    status, headers, _ = call(app, request(input="a", **{"\ud8ba\udc48": 1, "a\x01": 2, "x,y": 3, "ok": 4}))
    assert status == 200 and headers[b"x-selftune-ignored-fields"] == b"ok,(+3 more)"


def test_errors_of_the_endpoint_are_answered_in_the_api_format(engine):
    behind = Behind()
    app = EmbeddingsFastPath(behind, ServerState(engine, ServerLimits(max_items_per_request=2)))
    for body, status, param in (
        (request(input="a", model="gpt-4"), 404, "model"),
        (request(input=["a", "b", "c"]), 400, "input"),
        (request(input=[""]), 400, "input"),
        (request(input="a", dimensions=12), 400, "dimensions"),
    ):
        got, headers, answer = call(app, body)
        assert got == status and headers[b"content-type"] == b"application/json"
        assert json.loads(answer)["error"]["param"] == param
    assert behind.bodies == []


@pytest.mark.parametrize(
    "case",
    [
        dict(body=request(input=42)),  # does not validate: FastAPI words the error
        dict(body=b'{"model": "x", "input": '),  # not JSON
        dict(body=request(input="a", encoding_format="hex")),  # a known field with a bad value
        dict(body=request(input="a"), length=False),  # chunked: the size limit counts as it streams
        dict(body=request(input="a"), content_type=b"text/plain"),
        dict(body=request(input="a"), path="/v1/embeddings/"),
        dict(body=request(input="a"), method="PUT"),
    ],
)
def test_anything_else_reaches_the_app_behind_with_its_body_intact(engine, case):
    behind = Behind()
    app = EmbeddingsFastPath(behind, ServerState(engine, ServerLimits()))
    status, _, _ = call(app, **case, pieces=2)
    assert status == 418
    assert behind.bodies == [case["body"]]


def test_the_fast_path_times_what_it_answers_and_leaves_a_body_over_the_limit_to_the_app(engine):
    behind = Behind()
    body = request(input="a sentence to embed")
    app = EmbeddingsFastPath(behind, ServerState(engine, ServerLimits(max_body_bytes=len(body))))
    before = int(engine.latency.snapshot()["total"][0].sum())
    assert call(app, body)[0] == 200 and call(app, request(input="a", model="gpt-4"))[0] == 404
    assert int(engine.latency.snapshot()["total"][0].sum()) == before + 2  # answers and errors, as RequestTiming counts them
    over = request(input="a sentence to embed!")
    assert call(app, over)[0] == 418 and behind.bodies == [over]  # the app's BodySizeLimit answers it (413)
    assert int(engine.latency.snapshot()["total"][0].sum()) == before + 2
