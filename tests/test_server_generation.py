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
        # a client that hard-codes "gpt-4o-mini" can talk to this server unchanged
        # fp32: some tests compare with the fp32 model's own logprobs (dtype auto may serve bf16 here)
        "model": {"name": "builtin:smollm2", "task": "generate", "dtype": "float32", "served_names": [MODEL, "gpt-4o-mini"]},
        "concurrency": {"process_count": 1, "threads_per_process": 2, "max_batch_size": 4},
        # 8 s: the deadline test waits for it; every other generation here finishes well within
        "limits": {"request_timeout_seconds": 8, "max_queued_tokens": 5000},
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


def test_kv_cache_shows_in_stats_and_metrics(client, server):
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    (worker,) = httpx.get(server.url + "/stats").json()["workers"]
    assert worker["kv_tokens_total"] > 0 and worker["preemptions"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert f'selftune_worker_kv_cache_capacity_tokens{{worker="{worker["worker_id"]}"}} {float(worker["kv_tokens_total"])}' in metrics


def test_generation_knobs_show_in_stats_and_the_generate_policy_runs_by_default(client, server):
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    stats = httpx.get(server.url + "/stats").json()
    knobs = stats["knobs"]
    (worker,) = stats["workers"]
    assert (worker["max_running_sequences"], worker["max_batch_tokens"]) == (knobs["max_batch_size"], knobs["max_batch_tokens"])
    assert "policy generate from" in server.log() and "generate.yaml" in server.log()


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
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400),
        ({"model": MODEL, "prompt": "hi", "min_tokens": 20, "max_tokens": 10}, 400),
        ({"model": MODEL, "prompt": "hi", "stop_token_ids": [10**8]}, 400),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"nope": 1}}, 400),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"10000000": 1}}, 400),
        ({"model": MODEL, "prompt": "hi", "echo": True}, 400),
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


# ---- what the ecosystem's clients send (OpenAI's current parameters, vLLM's extensions) ------


@pytest.fixture(scope="module")
def smollm2():
    """The served model, in this process: the reference for greedy tokens and log-probabilities."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import EngineConfig
    from engine.model_source import resolve_model

    path = resolve_model("builtin:smollm2", EngineConfig().cache_dir).path
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy_with_logprobs(smollm2, prompt_ids: list[int], steps: int) -> list[tuple[int, "torch.Tensor"]]:
    import torch

    _, model = smollm2
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(steps):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(logprobs.argmax())
            out.append((token, logprobs))
            ids.append(token)
    return out


def test_chat_content_parts_are_joined_text_and_other_parts_are_refused(client):
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0).choices[0].message.content == plain.choices[0].message.content
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=4)
    assert "'image_url'" in err.value.body["message"] and err.value.body["param"] == "messages.0.content.1.type"


def test_max_completion_tokens_wins_and_ignore_eos_fixes_the_length(client):
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    natural = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and natural < 20
    fixed = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                           max_completion_tokens=natural + 4, extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == natural + 4 and fixed.choices[0].finish_reason == "length"
    assert fixed.choices[0].message.content.startswith(free.choices[0].message.content)
    longer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, extra_body={"min_tokens": natural + 3})
    assert longer.usage.completion_tokens >= natural + 3


def test_n_gives_that_many_choices_whole_and_streamed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    whole = client.completions.create(n=3, **kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) > 1, "three seeded samples were identical"
    assert whole.usage.completion_tokens == 18 and whole.usage.prompt_tokens > 0
    assert [c.text for c in client.completions.create(n=3, **kwargs).choices] == texts  # seeded: repeatable
    chunks = list(client.completions.create(n=3, stream=True, **kwargs))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


def test_stop_strings_cut_the_text_alike_whole_and_streamed(client):
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    assert " 8," in free
    whole = client.completions.create(stop=["xyz", " 8,"], **kwargs)
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == free[: free.index(" 8,")]
    streamed = list(client.completions.create(stop=["xyz", " 8,"], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_are_the_models_log_softmax(client, smollm2):
    tokenizer, _ = smollm2
    prompt = "The capital of France is"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    reference = greedy_with_logprobs(smollm2, tokenizer(prompt)["input_ids"], 4)
    assert lp.tokens == [tokenizer.decode([token]) for token, _ in reference]
    for i, (token, logprobs) in enumerate(reference):
        assert lp.token_logprobs[i] == pytest.approx(float(logprobs[token]), abs=2e-3)
        top = logprobs.topk(3)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=2e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
    streamed = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, stream=True))
    lps = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx([e.logprob for e in content])


def test_penalties_top_k_and_stop_token_ids_change_the_output(client, smollm2):
    tokenizer, _ = smollm2
    kwargs = dict(model=MODEL, prompt="hello hello hello hello hello hello", max_tokens=10, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert plain.startswith(" hello hello hello")  # the model repeats itself: what penalties are for
    assert client.completions.create(frequency_penalty=2.0, **kwargs).choices[0].text != plain
    assert client.completions.create(presence_penalty=2.0, **kwargs).choices[0].text != plain
    assert client.completions.create(extra_body={"repetition_penalty": 2.0}, **kwargs).choices[0].text != plain
    sampled = {**kwargs, "temperature": 1.0, "seed": 3}
    assert client.completions.create(extra_body={"top_k": 1}, **sampled).choices[0].text == plain
    tokens = [t for t, _ in greedy_with_logprobs(smollm2, tokenizer(kwargs["prompt"])["input_ids"], 10)]
    at = next(i for i in range(2, 10) if tokens[i] not in tokens[:i])
    cut = client.completions.create(extra_body={"stop_token_ids": [tokens[at]]}, **kwargs)
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == at + 1
    banned = client.completions.create(logit_bias={str(tokens[0]): -100}, logprobs=0, **kwargs).choices[0].logprobs.tokens
    assert banned[0] != tokenizer.decode([tokens[0]])


def test_what_cannot_be_done_is_a_400_naming_it_and_unknown_fields_are_listed(client):
    refused = [
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), "tools"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}), "response_format"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(tool_choice="required"), "tool_choice"),
    ]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **extra)
        assert err.value.body["param"] == param, err.value.body
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=2, user="u-1",
                                                          response_format={"type": "text"}, extra_body={"priority": 1, "guided_regex": "a"})
    assert raw.headers["x-selftune-ignored-fields"] == "guided_regex,priority"
    assert raw.parse().usage.completion_tokens == 2
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices


def test_served_names_are_listed_and_answered(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "gpt-4o-mini"]
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, max_tokens=4, temperature=0)
    assert reply.model == "gpt-4o-mini" and reply.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="SmolLM2-135M", messages=QUESTION, max_tokens=2)
