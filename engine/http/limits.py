"""Limits enforced before any work is done: body size (before JSON parsing) and admission."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from engine.http.errors import error_body


class BodySizeLimit:
    """ASGI middleware: a body over `max_bytes` gets 413 before anything parses it.

    A declared Content-Length is checked at once; a chunked body is counted as it streams
    in, and the read fails with a 413 HTTPException (which FastAPI passes through as is).
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"

    async def _reject(self, send):
        body = json.dumps(error_body(self._message(), "invalid_request_error", code="request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Admission:
    """Bounds the requests (and, for generation, the tokens) in the server at once.

    Beyond either bound a request is answered 429 before it costs any engine work. Every
    admitted request holds a Ticket that is released exactly once, whichever way the request
    ends, so the counts cannot drift. Used from the event loop's thread only.
    """

    def __init__(self, max_requests: int, max_tokens: int | None = None):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.current = 0
        self.tokens = 0
        self.rejected = 0

    def try_admit(self, tokens: int = 0) -> "Ticket | None":
        over_tokens = self.max_tokens is not None and tokens and self.tokens + tokens > self.max_tokens
        if self.current >= self.max_requests or over_tokens:
            self.rejected += 1
            return None
        self.current += 1
        self.tokens += tokens
        return Ticket(self, tokens)


class Ticket:
    def __init__(self, admission: Admission, tokens: int):
        self.admission = admission
        self.tokens = tokens
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.current -= 1
            self.admission.tokens -= self.tokens
