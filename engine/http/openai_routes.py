"""The OpenAI-compatible endpoints /v1/embeddings and /v1/models, and what every API route shares:
the served names, admission, waiting on the engine, the ignored-fields header.

(/v1/completions and /v1/chat/completions are in completions.py.)"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.types import Receive

from engine.http.errors import APIError, as_api_error
from engine.http.limits import Ticket
from engine.http.schemas import EmbeddingRequest, ignored_fields
from engine.http.state import ServerState
from engine.jobs import EngineError

log = logging.getLogger("selftune.http")
router = APIRouter(prefix="/v1")
IGNORED_HEADER = "x-selftune-ignored-fields"
MAX_LOGGED_IGNORED = 256
_logged_ignored: set[str] = set()


def state_of(request: Request) -> ServerState:
    return request.app.state.selftune


@router.get("/models")
async def list_models(request: Request):
    state = state_of(request)
    return {"object": "list", "data": [_model_card(state, name) for name in served_names(state)]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = state_of(request)
    check_model(state, model_id)
    return _model_card(state, model_id)


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "selftune", "task": state.engine.config.task,
            "max_model_len": state.engine.info.max_length}


def served_names(state: ServerState) -> tuple[str, ...]:
    """The names /v1/models lists: model.served_names, else the model's own name."""
    return state.served_names or (state.engine.source.name,)


def check_model(state: ServerState, model: str) -> None:
    """Requests may use a listed name; without served_names also the spec the model was served from."""
    names = served_names(state)
    if model not in names and (state.served_names or model != state.engine.config.model):
        raise APIError(404, f"model {model!r} is not served here; this server serves {', '.join(map(repr, names))}", param="model", code="model_not_found")


def check_task(state: ServerState, task: str) -> None:
    if state.engine.config.task != task:
        raise APIError(400, f"this server runs a {state.engine.config.task} model; this endpoint needs a {task} model")


def ignored_header(body: BaseModel) -> dict:
    """The response header naming the request's unknown fields, each logged once per server.

    Only printable ASCII names go into the header (a header is latin-1, and a client may send
    any string as a key), at most 16 of them; the log remembers a bounded number of names, so
    a client cycling through random keys cannot grow the server's memory or flood its log."""
    names = ignored_fields(body)
    if not names:
        return {}
    for name in names[:16]:
        if name not in _logged_ignored and len(_logged_ignored) < MAX_LOGGED_IGNORED:
            _logged_ignored.add(name)
            log.warning("ignoring the unknown request field %r (listed in the %s response header)", name[:100], IGNORED_HEADER)
    shown = [n for n in names if n.isascii() and n.isprintable() and "," not in n and len(n) <= 64][:16]
    hidden = len(names) - len(shown)
    return {IGNORED_HEADER: ",".join(shown + ([f"(+{hidden} more)"] if hidden else []))}


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
        )
    return ticket


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (`receive` is the request's, its body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _await_result(receive: Receive, state: ServerState, future, request_id_of):
    """Wait for an engine future; on deadline (504) or client disconnect, drop the work."""
    result = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(until_disconnect(receive))
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
    check_model(state, body.model)
    check_task(state, "embed")
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
    ticket = admit(state)  # released however the request ends
    try:
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
        shaping = engine.run_io(_embedding_payload, result, body.encoding_format, engine.source.name)
        # With no I/O threads the pool ran it already; wrapping a done future would still cost a
        # wake-up of the event loop through its self-pipe and another turn of it.
        payload = shaping.result() if shaping.done() else await asyncio.wrap_future(shaping)
        response = JSONResponse(payload, headers={**_timing_headers(result.timings), **ignored_header(body)})
    finally:
        ticket.release()
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
