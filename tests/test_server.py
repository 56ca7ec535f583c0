"""The real server process over loopback HTTP, driven by the `openai` package and raw HTTP."""

from __future__ import annotations

import base64
import concurrent.futures
import importlib.metadata
import json
import signal

import httpx
import numpy as np
import openai
import pytest
from conftest import minilm_dir
from autotune.bench.server import ServerProcess

from autotune.settings import ConfigError, load_config

TOKEN = "test-admin-token-123"
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {
        "model": {"name": "builtin:minilm", "dtype": "float32"},  # the exact fp32 path (auto may take bf16: tests/test_dtype.py)
        "concurrency": {"process_count": 2, "max_batch_size": 8, "batch_timeout": 0.002},
        "limits": {"max_items_per_request": 16, "max_body_bytes": 65536, "max_queued_requests": 64},
    }
    srv = ServerProcess(tmp_path_factory.mktemp("embed-server"), config, env={"SELFTUNE_ADMIN_TOKEN": TOKEN})
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir(), device="cpu")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_embeddings_float_and_base64_match_reference(client, reference):
    texts = ["hello world", "The quick brown fox jumps over the lazy dog.", "selftune"]
    expected = reference.encode(texts)
    for fmt in ("float", "base64"):
        response = client.embeddings.create(model=MODEL, input=texts, encoding_format=fmt)
        got = np.array([d.embedding for d in response.data], dtype=np.float32) if fmt == "float" else None
        if fmt == "base64":
            got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in response.data])
        assert np.abs(got - expected).max() < 1e-4
        assert [d.index for d in response.data] == [0, 1, 2]
        assert response.usage.prompt_tokens > len(texts)
    single = client.embeddings.create(model=MODEL, input="hello world")
    assert np.abs(np.array(single.data[0].embedding) - expected[0]).max() < 1e-4


def test_models_endpoint_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


BAD_REQUESTS = [
    ("malformed json", b'{"model": "all-MiniLM-L6-v2", "input": ', 400),
    ("wrong type", json.dumps({"model": MODEL, "input": 42}).encode(), 400),
    ("empty list", json.dumps({"model": MODEL, "input": []}).encode(), 400),
    ("empty string", json.dumps({"model": MODEL, "input": ""}).encode(), 400),
    ("over-long input", json.dumps({"model": MODEL, "input": "word " * 2000}).encode(), 400),
    ("too many items", json.dumps({"model": MODEL, "input": ["a"] * 17}).encode(), 400),
    ("unknown model", json.dumps({"model": "gpt-4", "input": "a"}).encode(), 404),
    ("bad encoding", json.dumps({"model": MODEL, "input": "a", "encoding_format": "hex"}).encode(), 400),
    ("token ids out of vocab", json.dumps({"model": MODEL, "input": [[1, 2, 10**9]]}).encode(), 400),
    ("not utf-8", b'{"model": "all-MiniLM-L6-v2", "input": "\xff\xfe"}', 400),
    ("deeply nested", b'{"model": "x", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("huge body", json.dumps({"model": MODEL, "input": "a" * 100_000}).encode(), 413),
    ("completion on an embedding model", json.dumps({"model": MODEL, "prompt": "hi"}).encode(), 400),
]


@pytest.mark.parametrize("name,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_4xx_with_a_message_and_the_server_stays_healthy(server, name, body, status):
    path = "/v1/completions" if "completion" in name else "/v1/embeddings"
    response = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert httpx.get(server.url + "/healthz").status_code == 200
    ok = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "still fine"}, timeout=30)
    assert ok.status_code == 200


def test_unknown_fields_are_ignored_named_in_a_header_and_the_rest_still_validated(server):
    """As vLLM does: a client's extension fields do not fail the request; the server says which it ignored."""
    for chunked in (False, True):  # the fast path and the FastAPI route alike
        raw = json.dumps({"model": MODEL, "input": "a", "temperature": 1, "priority": 3}).encode()
        response = httpx.post(server.url + "/v1/embeddings", content=iter([raw]) if chunked else raw,
                              headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["x-selftune-ignored-fields"] == "priority,temperature"
        assert len(response.json()["data"][0]["embedding"]) == 384
    plain = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "a"}, timeout=30)
    assert "x-selftune-ignored-fields" not in plain.headers
    bad = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "a", "encoding_format": "hex", "extra": 1}, timeout=30)
    assert bad.status_code == 400 and "encoding_format" in bad.json()["error"]["message"]


def test_health_version_and_tokenize_in_vllms_shapes(server):
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ready"
    version = httpx.get(server.url + "/version").json()["version"]
    assert version == importlib.metadata.version("selftune")
    tokens = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello world", "return_token_strs": True}).json()
    assert tokens["tokens"] == [101, 7592, 2088, 102] and tokens["count"] == 4 and tokens["max_model_len"] == 512
    assert tokens["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"]
    bare = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == [7592, 2088] and bare["token_strs"] is None
    assert httpx.post(server.url + "/detokenize", json={"tokens": [7592, 2088]}).json() == {"prompt": "hello world"}
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "model": "nope"}), ("/detokenize", {"tokens": [10**8]}),
                       ("/detokenize", {"tokens": "abc"})):
        response = httpx.post(server.url + path, json=body)
        assert 400 <= response.status_code < 500 and response.json()["error"]["message"], (path, body, response.text)


def test_fast_path_and_fastapi_route_answer_embeddings_alike(server):
    """With Content-Length a request takes the fast path; chunked, it takes the FastAPI route."""
    bodies = [
        {"model": MODEL, "input": ["same answer", "either way"], "encoding_format": "base64"},
        {"model": MODEL, "input": "floats"},
        {"model": "gpt-4", "input": "a"},
        {"model": MODEL, "input": ["a"] * 17},
        {"model": MODEL, "input": ""},
        {"model": MODEL, "input": [[1, 2, 10**9]]},
    ]
    for body in bodies:
        raw = json.dumps(body).encode()
        fast = httpx.post(server.url + "/v1/embeddings", content=raw, headers={"content-type": "application/json"}, timeout=30)
        routed = httpx.post(server.url + "/v1/embeddings", content=iter([raw]), headers={"content-type": "application/json"}, timeout=30)
        assert "content-length" not in routed.request.headers
        assert fast.status_code == routed.status_code, (body, fast.text, routed.text)
        if fast.status_code != 200:
            assert fast.json() == routed.json()
            continue
        a, b = fast.json(), routed.json()
        assert a["usage"] == b["usage"] and [d["index"] for d in a["data"]] == [d["index"] for d in b["data"]]
        vectors = [[np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") if isinstance(d["embedding"], str) else np.array(d["embedding"]) for d in r["data"]] for r in (a, b)]
        assert np.abs(np.array(vectors[0]) - np.array(vectors[1])).max() < 1e-5


def test_health_ready_and_stats(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready_workers"] >= 1
    stats = httpx.get(server.url + "/stats").json()
    assert stats["knobs"]["process_count"] == 2
    assert stats["model"]["name"] == MODEL
    assert {w["state"] for w in stats["workers"]} <= {"starting", "ready", "draining"}
    assert stats["counters"]["completed"] <= stats["counters"]["requests"]


def test_timing_headers_split_the_latency(server):
    response = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "timed"})
    parts = {k: float(response.headers[f"x-selftune-{k}-ms"]) for k in ("preprocess", "queue", "model", "total")}
    assert parts["model"] > 0
    assert parts["preprocess"] + parts["queue"] + parts["model"] <= parts["total"] + 0.5
    items, rows, row_tokens = map(int, response.headers["x-selftune-batch"].split(","))
    assert items >= 1 and 1 <= rows <= items and row_tokens >= 3  # "timed" is [CLS] timed [SEP] at least


def test_admin_requires_the_token(server):
    assert httpx.get(server.url + "/admin/knobs").status_code == 401
    wrong = httpx.get(server.url + "/admin/knobs", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_admin_put_changes_knobs_and_pins_them_and_invalid_put_changes_nothing(server):
    auth = {"authorization": f"Bearer {TOKEN}"}
    response = httpx.put(server.url + "/admin/knobs", json={"max_batch_size": 4, "batch_timeout": 0.01}, headers=auth)
    assert response.status_code == 200, response.text
    assert sorted(response.json()["pinned"]) == ["batch_timeout", "max_batch_size"]
    stats = httpx.get(server.url + "/stats").json()
    assert stats["knobs"]["max_batch_size"] == 4 and stats["knobs"]["batch_timeout"] == 0.01
    for bad in ({"max_batch_size": 0}, {"process_count": "three"}, {"threads_per_process": 10**6}, {"bogus": 1}, {}):
        r = httpx.put(server.url + "/admin/knobs", json=bad, headers=auth)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["message"]
    after = httpx.get(server.url + "/admin/knobs", headers=auth).json()
    assert after["knobs"] == stats["knobs"]
    unpinned = httpx.delete(server.url + "/admin/knobs/pin", headers=auth)
    assert unpinned.json()["pinned"] == []


def test_admin_put_process_count_starts_a_worker(server):
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.put(server.url + "/admin/knobs", json={"process_count": 3}, headers=auth).status_code == 200
    stats = httpx.get(server.url + "/stats").json()
    assert len([w for w in stats["workers"] if w["state"] != "draining"]) == 3
    assert httpx.put(server.url + "/admin/knobs", json={"process_count": 2}, headers=auth).status_code == 200


def test_overload_gets_429_with_retry_after_not_errors(tmp_path):
    config = {
        "model": {"name": "builtin:minilm"},
        "concurrency": {"process_count": 1, "max_batch_size": 1, "batch_timeout": 0},
        "limits": {"max_queued_requests": 2},
    }
    srv = ServerProcess(tmp_path, config)
    try:
        body = {"model": MODEL, "input": ["a fairly long sentence to keep the worker busy " * 8] * 4}
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            responses = list(pool.map(lambda _: httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60), range(48)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) > 0 and codes.count(200) > 0
        assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
        stats = httpx.get(srv.url + "/stats").json()
        assert stats["server"]["in_flight"] == 0 and stats["pending_requests"] == 0
    finally:
        assert srv.stop() == 0


def test_admin_is_off_without_a_token_and_sigterm_drains_in_flight_work(tmp_path):
    config = {"model": {"name": "builtin:minilm"}, "concurrency": {"process_count": 1}, "admin": {"token_env": "SELFTUNE_TEST_UNSET_TOKEN"}}
    srv = ServerProcess(tmp_path, config)
    off = httpx.get(srv.url + "/admin/knobs", headers={"authorization": "Bearer anything"})
    assert off.status_code == 403 and "SELFTUNE_TEST_UNSET_TOKEN" in off.json()["error"]["message"]
    body = {"model": MODEL, "input": ["a sentence that takes a little while " * 10] * 16}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(httpx.post, srv.url + "/v1/embeddings", json=body, timeout=60) for _ in range(4)]
        pending[0].result()  # the server is busy serving the rest now
        srv.proc.send_signal(signal.SIGTERM)
        assert all(f.result().status_code == 200 for f in pending)
    assert srv.stop() == 0
    assert "Application shutdown complete" in srv.log()


@pytest.mark.parametrize(
    "text,problem",
    [
        ("concurrency:\n  process_count: 0\n", "concurrency.process_count"),
        ("concurrency:\n  max_batch_sise: 8\n", "max_batch_sise: unknown key"),
        ("limits:\n  max_body_bytes: lots\n", "limits.max_body_bytes"),
        ("bounds:\n  process_count: {min: 4, max: 2}\n", "bounds.process_count"),
        ("concurrency:\n  process_count: 40\n", "outside the allowed range"),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("concurrency:\n  max_batch_tokens: -1\n", "concurrency.max_batch_tokens"),
        ("concurrency:\n  max_batch_tokens: lots\n", "concurrency.max_batch_tokens"),
        ("concurrency:\n  kv_tokens: 64\nbounds:\n  kv_tokens: {min: 128, max: 512}\n", "kv_tokens=64 is outside the allowed range [128, 512]"),
        ("bounds:\n  max_batch_tokens: {min: 64, max: 8}\n", "bounds.max_batch_tokens"),
        ("model:\n  prefill_chunk_tokens: 64\n", "prefill_chunk_tokens moved to concurrency.max_batch_tokens"),
    ],
)
def test_bad_config_names_the_file_and_the_key(tmp_path, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize("text,tokens", [
    ("", 32),  # auto, one thread per worker on a CPU
    ("concurrency:\n  threads_per_process: 2\n", 64),
    ("model:\n  device: cuda\n", 2048),
    ("concurrency:\n  max_batch_tokens: 100\n", 100),
    ("concurrency:\n  max_batch_tokens: 0\n", 0),
])
def test_the_prefill_token_budget_starts_from_the_device_and_the_threads(tmp_path, text, tokens):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(path).engine_config().knobs.max_batch_tokens == tokens


def test_bad_config_stops_the_server_from_starting(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("concurrency:\n  threads_per_process: -1\n")
    result = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "concurrency.threads_per_process" in result.stderr and str(path) in result.stderr


def test_default_config_loads_and_documents_every_key():
    from autotune.settings import DEFAULT_CONFIG, ServerConfig

    config = load_config(DEFAULT_CONFIG)
    text = DEFAULT_CONFIG.read_text()
    for section, model in ServerConfig.model_fields.items():
        assert f"{section}:" in text
        for key in model.annotation.model_fields:
            assert f"{key}:" in text, f"configs/default.yaml does not document {section}.{key}"
    assert config.engine_config().model == "builtin:minilm"


def test_an_encoder_refuses_to_serve_generate(tiny_causal_lm):
    """AutoModelForCausalLM would load MiniLM (BERT) with a fresh, untrained head and stream noise:
    the start fails instead, naming the task and the architecture, before any worker starts."""
    import subprocess
    import sys

    from transformers import AutoConfig

    from engine.loading import check_task

    result = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--model", "builtin:minilm", "--task", "generate", "--port", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "BertModel" in result.stderr and "task: generate" in result.stderr and "--task embed" in result.stderr
    assert "worker 0" not in result.stderr
    check_task(AutoConfig.from_pretrained(tiny_causal_lm), "generate", tiny_causal_lm)  # GPT2LMHeadModel: served
    check_task(AutoConfig.from_pretrained(minilm_dir()), "embed", minilm_dir())
