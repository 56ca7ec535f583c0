"""/v1/completions and /v1/chat/completions: request -> SamplingParams -> n generations -> response or stream."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.http.choices import Choice, Completion
from engine.http.errors import APIError, as_api_error, error_body
from engine.http.limits import Ticket
from engine.http.openai_routes import admit, check_model, check_task, ignored_header, state_of, until_disconnect
from engine.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.http.state import ServerState
from engine.jobs import EngineError
from engine.sampling import SamplingParams

router = APIRouter(prefix="/v1")


@router.post("/completions")
async def create_completion(body: CompletionRequest, request: Request):
    state = checked(request, body)
    if body.echo:
        raise APIError(400, "echo is not supported by this server", param="echo")
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported by this server; use n", param="best_of")
    prompt = body.prompt
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return await generate(request, state, body, prompt, chat=False, logprobs=body.logprobs)


@router.post("/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = checked(request, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await generate(request, state, body, chat_prompt_ids(state, body.messages), chat=True, logprobs=logprobs)


def checked(request: Request, body: SamplingFields) -> ServerState:
    """The server state, once the request names a served model, the server generates and
    nothing is asked for that it cannot do."""
    state = state_of(request)
    check_model(state, body.model)
    check_task(state, "generate")
    refuse_unsupported(body)
    return state


def refuse_unsupported(body: SamplingFields) -> None:
    """A 400 naming the parameter, for what a local text model served here cannot do."""
    if body.tools:
        raise APIError(400, "tools (function calling) are not supported by this server", param="tools")
    if body.functions:
        raise APIError(400, "functions (function calling) are not supported by this server", param="functions")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none", "auto"):
            raise APIError(400, f"{name} is not supported by this server (no tools)", param=name)
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise APIError(400, f"response_format of type {kind!r} is not supported by this server (text only)", param="response_format")


def chat_prompt_ids(state: ServerState, messages, add_generation_prompt: bool = True) -> list[int]:
    """The chat template applied to the messages; text content parts are joined."""
    tokenizer = state.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    plain = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)", param=f"messages.{i}.content.{j}.type")
                if part.text is None:
                    raise APIError(400, "a text content part needs text", param=f"messages.{i}.content.{j}.text")
            content = "".join(part.text for part in content)
        plain.append({"role": message.role, "content": content or "", **({"name": message.name} if message.name else {})})
    ids = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
    """The params of choice `choice` of n: a seeded request's choices differ (seed + choice)."""
    bias = []
    for key, value in (body.logit_bias or {}).items():
        try:
            bias.append((int(key), value))
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids; got {key!r}", param="logit_bias") from None
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=None if body.seed is None else (body.seed + choice) % 2**63,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        top_k=body.top_k or 0,
        min_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos),
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=tuple(bias),
        logprobs=logprobs,
    )


async def generate(request: Request, state: ServerState, body: SamplingFields, prompt, chat: bool, logprobs: int | None):
    engine = state.engine
    max_tokens = body.max_completion_tokens or body.max_tokens or state.limits.default_max_tokens
    n = body.n or 1
    params = [sampling_params(body, max_tokens, logprobs, i) for i in range(n)]
    prompt_ids = engine.prompt_ids(prompt)
    try:
        engine.check_generation(prompt_ids, params[0])
    except ValueError as exc:
        raise as_api_error(exc) from None
    cost = n * (len(prompt_ids) + max_tokens)
    budget = state.admission.max_tokens
    if budget is not None and cost > budget:
        raise APIError(400, f"n × (prompt + max_tokens) ({cost}) is more than this server ever queues ({budget} tokens); "
                       "lower max_tokens or n", param="max_tokens")
    ticket = admit(state, tokens=cost)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    completion = Completion(engine.tokenizer, body.model, len(prompt_ids), chat, logprobs is not None)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    ended = set()

    def listener(index: int):
        def on_event(event):
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
            if isinstance(event, Exception) or event.finish_reason is not None:
                ended.add(index)  # set.add is atomic; the ticket goes when every choice has ended
                if len(ended) == n:
                    loop.call_soon_threadsafe(ticket.release)  # however the response ends, or never starts
        return on_event

    try:
        for i, p in enumerate(params):
            stream = engine.generate(prompt_ids, p, on_event=listener(i))
            completion.choices.append(Choice(i, stream.request_id, engine.tokenizer, stop))
    except (EngineError, ValueError) as exc:
        _cancel(state, completion)
        ticket.release()
        raise as_api_error(exc) from None
    headers = ignored_header(body)
    if not body.stream:
        try:
            return await _whole(request, state, completion, events, headers)
        finally:
            ticket.release()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    deadline = time.monotonic() + state.limits.request_timeout
    try:
        first = await _first_event(request, state, events, deadline)
    except BaseException:  # an error status, or this task cancelled: no stream will release the ticket
        _cancel(state, completion)
        ticket.release()
        raise
    return StreamingResponse(_sse(state, completion, events, include_usage, ticket, first, deadline), media_type="text/event-stream", headers=headers)


def _cancel(state: ServerState, completion: Completion) -> None:
    for choice in completion.choices:
        if not choice.done:
            state.engine.cancel(choice.request_id)


def _feed(state: ServerState, completion: Completion, index: int, event) -> tuple[Choice, str, bool]:
    """Hand one event to its choice: (the choice, its new text, whether this event ended it).
    An error raises; a choice cut by a stop string stops its generation."""
    if isinstance(event, Exception):
        raise event
    choice = completion.choices[index]
    if choice.done:
        return choice, "", False  # a token already on its way when a stop string ended the choice
    text = choice.feed(event)
    if choice.done and event.finish_reason is None:
        state.engine.cancel(choice.request_id)
    return choice, text, choice.done


async def _next_event(events: asyncio.Queue, deadline: float):
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise asyncio.TimeoutError
    return await asyncio.wait_for(events.get(), timeout)


def _timeout(state: ServerState) -> APIError:
    state.timed_out += 1
    return APIError(504, f"the request did not finish within {state.limits.request_timeout:g}s", "timeout_error", code="timeout")


async def _event_or_hang_up(events: asyncio.Queue, deadline: float, watcher: asyncio.Future):
    """The next event, or 499 if the client went away first."""
    getter = asyncio.ensure_future(_next_event(events, deadline))
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if watcher in done:
        getter.cancel()
        raise APIError(499, "client closed the request")
    return getter.result()


async def _first_event(request: Request, state: ServerState, events: asyncio.Queue, deadline: float):
    """A stream's first event, awaited before the response starts: a request that ends before its
    first token (shed after its queue limit, timed out, failed) gets its own HTTP status (429,
    504, 5xx) instead of a 200 whose stream carries the error."""
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        index, event = await _event_or_hang_up(events, deadline, watcher)
    except asyncio.TimeoutError:
        raise _timeout(state) from None
    finally:
        watcher.cancel()
    if isinstance(event, EngineError):
        raise as_api_error(event)
    return index, event


async def _whole(request: Request, state: ServerState, completion: Completion, events: asyncio.Queue, headers: dict):
    deadline = time.monotonic() + state.limits.request_timeout
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
    texts = [[] for _ in completion.choices]
    try:
        while not completion.done:
            choice, text, _ = _feed(state, completion, *await _event_or_hang_up(events, deadline, watcher))
            texts[choice.index].append(text)
    except asyncio.TimeoutError:
        raise _timeout(state) from None
    except EngineError as exc:
        raise as_api_error(exc) from None
    finally:
        watcher.cancel()
        _cancel(state, completion)
    return JSONResponse(completion.whole(["".join(t) for t in texts]), headers=headers)


async def _sse(state: ServerState, completion: Completion, events: asyncio.Queue, include_usage: bool, ticket: Ticket, first, deadline: float):
    """Server-sent events, `first` (already taken off `events`) first; if the client goes away,
    Starlette cancels this and the work stops."""
    try:
        if completion.chat:
            for choice in completion.choices:
                yield _event(completion.chunk(choice, None, first=True))
        while not completion.done:
            event, first = first or await _next_event(events, deadline), None
            choice, text, ended = _feed(state, completion, *event)
            if text:
                yield _event(completion.chunk(choice, text))
            if ended:
                yield _event(completion.chunk(choice, None))
        if include_usage:
            yield _event(completion.usage_chunk())
        yield "data: [DONE]\n\n"
    except asyncio.TimeoutError:
        yield _event(error_body(_timeout(state).message, "timeout_error", code="timeout"))
    except EngineError as exc:
        err = as_api_error(exc)
        yield _event(error_body(err.message, err.type, code=err.code))
    finally:
        ticket.release()
        _cancel(state, completion)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
