"""The OpenAI-compatible endpoints: /v1/embeddings, /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from contextlib import asynccontextmanager

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from engine.engine import GenerationParams
from engine.http.detokenize import Detokenizer
from engine.http.errors import APIError, as_api_error, error_body
from engine.http.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, SamplingFields
from engine.http.limits import Ticket
from engine.http.state import ServerState
from engine.jobs import EngineError, TokenEvent

router = APIRouter(prefix="/v1")


def state_of(request: Request) -> ServerState:
    return request.app.state.selftune


@router.get("/models")
async def list_models(request: Request):
    state = state_of(request)
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = state_of(request)
    _check_model(state, model_id)
    return _model_card(state)


def _model_card(state: ServerState) -> dict:
    return {"id": state.engine.source.name, "object": "model", "created": 0, "owned_by": "selftune", "task": state.engine.config.task}


def _check_model(state: ServerState, model: str) -> None:
    name = state.engine.source.name
    if model not in (name, state.engine.config.model):
        raise APIError(404, f"model {model!r} is not served here; this server serves {name!r}", param="model", code="model_not_found")


def _check_task(state: ServerState, task: str) -> None:
    if state.engine.config.task != task:
        raise APIError(400, f"this server runs a {state.engine.config.task} model; this endpoint needs a {task} model")


def admit(state: ServerState, tokens: int = 0) -> Ticket:
    """A ticket for this request, or 503 (draining) / 429 (full) before any work is done."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "service_unavailable")
    ticket = state.admission.try_admit(tokens)
    if ticket is None:
        a = state.admission
        what = f"{a.max_requests} requests" + (f" / {a.max_tokens} tokens" if a.max_tokens else "")
        raise APIError(
            429,
            f"the server is full ({what} in flight); retry shortly",
            "rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(state.limits.retry_after_seconds)},
        )
    return ticket


@asynccontextmanager
async def admitted(state: ServerState):
    ticket = admit(state)
    try:
        yield
    finally:
        ticket.release()


async def _until_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (`receive` is the request's, its body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _await_result(receive: Receive, state: ServerState, future, request_id_of):
    """Wait for an engine future; on deadline (504) or client disconnect, drop the work."""
    result = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({result, watcher}, timeout=state.limits.request_timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if result in done:
        return result.result()
    request_id = request_id_of()
    if request_id is not None:
        state.engine.cancel(request_id)
    if watcher in done:
        raise APIError(499, "client closed the request")
    state.timed_out += 1
    raise APIError(504, f"the request did not finish within {state.limits.request_timeout:g}s", "timeout_error", code="timeout")


# ---- embeddings ------------------------------------------------------------------------------


@router.post("/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request):
    return await embeddings(state_of(request), body, request.receive)


async def embeddings(state: ServerState, body: EmbeddingRequest, receive: Receive) -> Response:
    """The endpoint's work, shared by the route and `EmbeddingsFastPath`; errors raise APIError.

    `receive` is the request's ASGI receive, its body already read: a disconnect drops the work.
    """
    _check_model(state, body.model)
    _check_task(state, "embed")
    inputs = body.input
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    if len(inputs) > state.limits.max_items_per_request:
        raise APIError(400, f"input has {len(inputs)} items; at most {state.limits.max_items_per_request} per request", param="input")
    hidden = state.engine.info.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(400, f"dimensions={body.dimensions}: this model's embeddings have {hidden} dimensions", param="dimensions")
    async with admitted(state):
        engine = state.engine
        try:
            if isinstance(inputs[0], str):
                if any(not text for text in inputs):
                    raise APIError(400, "input strings must not be empty", param="input")
                future = engine.embed(inputs)
            else:
                future = engine.embed_tokens(inputs)
            result = await _await_result(receive, state, future, lambda: getattr(future, "request_id", None))
        except (EngineError, ValueError) as exc:
            raise as_api_error(exc) from None
        shaped = time.monotonic()
        payload = await asyncio.wrap_future(engine.run_io(_embedding_payload, result, body.encoding_format, engine.source.name))
        response = JSONResponse(payload, headers=_timing_headers(result.timings))
    engine.latency.record("postprocess", time.monotonic() - shaped)
    return response


def _embedding_payload(result, encoding_format: str, model: str) -> dict:
    vectors = result.vectors
    if encoding_format == "base64":
        data = [base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    else:
        data = vectors.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


def _timing_headers(timings) -> dict:
    return {
        "x-selftune-preprocess-ms": f"{timings.preprocess * 1000:.3f}",
        "x-selftune-queue-ms": f"{timings.queue * 1000:.3f}",
        "x-selftune-model-ms": f"{timings.model * 1000:.3f}",
        "x-selftune-total-ms": f"{timings.total * 1000:.3f}",
        "x-selftune-batch": "{},{},{}".format(*timings.batch),
    }


# ---- completions -----------------------------------------------------------------------------


@router.post("/completions")
async def create_completion(body: CompletionRequest, request: Request):
    state = state_of(request)
    _check_model(state, body.model)
    _check_task(state, "generate")
    prompt = body.prompt
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return await _generate(request, state, body, prompt, chat=False)


@router.post("/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = state_of(request)
    _check_model(state, body.model)
    _check_task(state, "generate")
    tokenizer = state.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    return await _generate(request, state, body, list(prompt_ids), chat=True)


async def _generate(request: Request, state: ServerState, body: SamplingFields, prompt, chat: bool):
    engine = state.engine
    max_tokens = body.max_tokens or state.limits.default_max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = GenerationParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    prompt_ids = engine.prompt_ids(prompt)
    try:
        engine.check_generation(prompt_ids, max_tokens)
    except ValueError as exc:
        raise as_api_error(exc) from None
    cost = len(prompt_ids) + max_tokens
    budget = state.admission.max_tokens
    if budget is not None and cost > budget:
        raise APIError(400, f"prompt + max_tokens ({cost}) is more than this server ever queues ({budget} tokens); lower max_tokens", param="max_tokens")
    ticket = admit(state, tokens=cost)

    def on_event(event):
        loop.call_soon_threadsafe(events.put_nowait, event)
        if isinstance(event, Exception) or event.finish_reason is not None:
            loop.call_soon_threadsafe(ticket.release)  # however the response ends, or never starts

    try:
        stream = engine.generate(prompt_ids, params, on_event=on_event)
    except (EngineError, ValueError) as exc:
        ticket.release()
        raise as_api_error(exc) from None
    completion = _Completion(engine, body.model, stream.request_id, stream.prompt_tokens, stop, chat)
    if not body.stream:
        try:
            return await _whole(request, state, completion, events)
        finally:
            ticket.release()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_sse(state, completion, events, include_usage, ticket), media_type="text/event-stream")


class _Completion:
    """Accumulates one generation's tokens into text and shapes OpenAI responses."""

    def __init__(self, engine, model: str, request_id: int, prompt_tokens: int, stop: list[str], chat: bool):
        self.engine = engine
        self.model = model
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.detok = Detokenizer(engine.tokenizer, stop)
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tokens = 0
        self.finish_reason: str | None = None

    def feed(self, event: TokenEvent) -> str:
        self.tokens += 1
        text = self.detok.add(event.token_id, final=event.finish_reason is not None)
        if self.detok.stopped:
            self.finish_reason = "stop"
            self.engine.cancel(self.request_id)
        elif event.finish_reason is not None:
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
        return text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens, "total_tokens": self.prompt_tokens + self.tokens}

    def whole(self, text: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": self.finish_reason, "logprobs": None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, first: bool = False, usage: bool = False) -> dict:
        finish = self.finish_reason if text is None and not usage else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            kind = "chat.completion.chunk"
        else:
            choices = [] if usage else [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
            kind = "text_completion"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage:
            out["usage"] = self.usage()
        return out


async def _next_event(events: asyncio.Queue, deadline: float):
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise asyncio.TimeoutError
    event = await asyncio.wait_for(events.get(), timeout)
    if isinstance(event, Exception):
        raise event
    return event


async def _whole(request: Request, state: ServerState, completion: _Completion, events: asyncio.Queue):
    deadline = time.monotonic() + state.limits.request_timeout
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    parts = []
    try:
        while not completion.done:
            getter = asyncio.ensure_future(_next_event(events, deadline))
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                getter.cancel()
                raise APIError(499, "client closed the request")
            parts.append(completion.feed(getter.result()))
    except asyncio.TimeoutError:
        state.timed_out += 1
        raise APIError(504, f"the request did not finish within {state.limits.request_timeout:g}s", "timeout_error", code="timeout") from None
    except EngineError as exc:
        raise as_api_error(exc) from None
    finally:
        watcher.cancel()
        if not completion.done:
            state.engine.cancel(completion.request_id)
    return completion.whole("".join(parts))


async def _sse(state: ServerState, completion: _Completion, events: asyncio.Queue, include_usage: bool, ticket: Ticket):
    """Server-sent events; if the client goes away, Starlette cancels this and the work stops."""
    deadline = time.monotonic() + state.limits.request_timeout
    try:
        if completion.chat:
            yield _event(completion.chunk(None, first=True))
        while not completion.done:
            text = completion.feed(await _next_event(events, deadline))
            if text:
                yield _event(completion.chunk(text))
        yield _event(completion.chunk(None))
        if include_usage:
            yield _event(completion.chunk(None, usage=True))
        yield "data: [DONE]\n\n"
    except asyncio.TimeoutError:
        state.timed_out += 1
        yield _event(error_body(f"the request did not finish within {state.limits.request_timeout:g}s", "timeout_error", code="timeout"))
    except EngineError as exc:
        err = as_api_error(exc)
        yield _event(error_body(err.message, err.type, code=err.code))
    finally:
        ticket.release()
        if not completion.done:
            state.engine.cancel(completion.request_id)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
