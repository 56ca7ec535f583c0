"""Ray Serve proxy middleware: an embeddings request whose replica died is sent to another one.

Embeddings are idempotent, so when the replica answering one dies (its actor killed, its node
gone) the proxy's 500 never reaches the client: the request goes again, and Ray Serve's router,
which has seen the replica die, picks a live one. A generation that has started to stream
cannot be replayed; it ends with a typed error event (`replica_lost`) instead of a cut stream.

Ray Serve loads it in every proxy from the environment variable
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=autotune.cluster.proxy_retry:middlewares
(set by `selftune serve --ray local:N`; on a real cluster, in the nodes' environment).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from starlette.middleware import Middleware

log = logging.getLogger("selftune.cluster")

RETRIED_PATHS = ("/v1/embeddings", "/embeddings")
SELFTUNE_ERROR = b'{"error"'
"""How every error selftune's own app answers begins; a 500 that does not is Ray's."""
BACKOFF_SECONDS = 0.2
"""Before attempt n + 1: n × this, so that Ray's router has seen the replica die."""


def middlewares() -> list[Middleware]:
    return [Middleware(ReplicaLossMiddleware, retries=int(os.environ.get("SELFTUNE_RAY_RETRIES", "3")))]


def replica_lost(status: int, body: bytes) -> bool:
    """The proxy's answer when the replica died under the request: a 500 with Ray's error text
    (not selftune's JSON error), or no answer at all (status 0: the proxy gave up without one)."""
    return status == 0 or (status == 500 and not body.lstrip().startswith(SELFTUNE_ERROR))


class _Captured:
    """A response held back until it is known not to be a lost replica's."""

    def __init__(self):
        self.messages: list[dict] = []
        self.status = 0
        self.body = b""

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
        self.messages.append(message)


class ReplicaLossMiddleware:
    def __init__(self, app, retries: int = 2):
        self.app = app
        self.retries = retries

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if scope.get("path") in RETRIED_PATHS:
            return await self._with_retries(scope, receive, send)
        return await self._typed_loss(scope, receive, send)

    async def _with_retries(self, scope, receive, send):
        body = await _read_body(receive)
        for attempt in range(self.retries + 1):
            captured = _Captured()
            await self.app(scope, _replay(body, receive), captured.send)
            if not replica_lost(captured.status, captured.body) or attempt == self.retries:
                break
            log.warning("replica lost under an embeddings request; sending it again (attempt %d of %d)", attempt + 2, self.retries + 1)
            await asyncio.sleep(BACKOFF_SECONDS * (attempt + 1))
        for message in captured.messages:
            await send(message)

    async def _typed_loss(self, scope, receive, send):
        """Everything else passes through. An event stream that ends without its `data: [DONE]`
        lost its replica (however Ray's proxy ends it: an exception, an empty last chunk, or its
        error text): its last event says so, typed, instead of a stream that merely stops."""
        stream = _StreamWatch()

        async def watch(message):
            if message["type"] == "http.response.start":
                stream.started(message)
            elif stream.sse and message["type"] == "http.response.body":
                last = not message.get("more_body", False)
                if last and not stream.done(message.get("body", b"")):
                    body = message.get("body", b"")
                    body = body if body.lstrip().startswith(b"data:") else b""  # events stay; Ray's error text goes
                    message = {"type": "http.response.body", "body": body + _lost_event(), "more_body": False}
                stream.done(message.get("body", b""))
                stream.closed = last
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not stream.sse:
                raise
            await send({"type": "http.response.body", "body": _lost_event(), "more_body": False})
            return
        if stream.sse and not stream.closed:
            # Ray's proxy returns without closing a stream whose replica died mid-way.
            await send({"type": "http.response.body", "body": _lost_event(), "more_body": False})


class _StreamWatch:
    """Whether a response is an event stream, and whether its end marker has gone by."""

    def __init__(self):
        self.sse = False
        self._tail = b""
        self._finished = False
        self.closed = False
        """The last body message (more_body false) has gone to the client."""

    def started(self, message: dict) -> None:
        headers = dict(message.get("headers", []))
        self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")

    def done(self, chunk: bytes) -> bool:
        self._tail = (self._tail + chunk)[-64:]  # the marker may straddle two chunks
        self._finished = self._finished or b"data: [DONE]" in self._tail
        return self._finished


def _lost_event() -> bytes:
    error = {"error": {"type": "replica_lost", "code": 503, "message": "the replica generating this stream died; the output above is incomplete"}}
    return f"data: {json.dumps(error)}\n\n".encode()


async def _read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def _replay(body: bytes, receive):
    """The request's body again, then the client's own channel (which only tells a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
