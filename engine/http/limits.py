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
    """Bounds the requests in the server at once; beyond it a request is answered 429.

    Counted in the front process, so a rejected request costs no engine work, and every
    admitted request leaves through `release` (a `finally`), so the count cannot drift.
    """

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self.current = 0
        self.rejected = 0

    def try_admit(self) -> bool:
        if self.current >= self.max_requests:
            self.rejected += 1
            return False
        self.current += 1
        return True

    def release(self) -> None:
        self.current -= 1
