"""POST /v1/embeddings ahead of every FastAPI layer.

Embedding requests are small and many, and the front process shares the cores with the
workers: FastAPI's route matching, dependency solving, body parsing and middleware layers cost
about as much CPU per request as everything else the front does for it together (see
docs/BENCHMARKS.md, "Front-process CPU per request"). `SelftuneAPI` (engine/http/app.py) calls
this first; it answers a well-formed request itself, through the same handler as the route
(`openai_routes.embeddings`), records its end-to-end time as `RequestTiming` would, and lets
uvicorn answer 500 for anything unexpected, as Starlette's error middleware would. Anything
else goes on to FastAPI untouched: another path or method, a body without Content-Length
(chunked: the size limit is enforced while it streams) or declared over the size limit, or not
declared JSON, and a body that does not validate (replayed, so the error is FastAPI's, in the
API's one error format).
"""

from __future__ import annotations

import time

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.http.errors import APIError, api_error_response
from engine.http.openai_routes import embeddings
from engine.http.schemas import EmbeddingRequest
from engine.http.state import ServerState

PATH = "/v1/embeddings"


class EmbeddingsFastPath:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _takes(scope, self.state.limits.max_body_bytes):
            return await self.app(scope, receive, send)
        started = time.monotonic()
        body = await _read_body(receive)
        if body is None:
            return  # the client left while sending; there is nobody to answer
        try:
            request = EmbeddingRequest.model_validate_json(body)
        except ValidationError:
            return await self.app(scope, _replay(body, receive), send)
        try:
            response = await embeddings(self.state, request, receive)
        except APIError as exc:
            response = api_error_response(exc, self.state.limits.retry_after_seconds)
        await response(scope, receive, send)
        self.state.engine.latency.record("total", time.monotonic() - started)


def _takes(scope: Scope, max_bytes: int) -> bool:
    if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
        return False
    headers = dict(scope["headers"])
    media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    length = headers.get(b"content-length", b"")
    return media_type == b"application/json" and length.isdigit() and int(length) <= max_bytes


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then whatever the connection says next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
