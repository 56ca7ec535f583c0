"""One mapping from what went wrong to an HTTP status and OpenAI's error JSON shape."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import KnobError
from engine.jobs import EngineClosed, InputTooLong, ModelFailed, QueueTimeout, WorkerLost


class APIError(Exception):
    """An error with its HTTP status, OpenAI error type and optional parameter name."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def api_error_response(exc: APIError, retry_after_seconds: int) -> JSONResponse:
    """The error's response; a 429 (admission full, or shed from the queue) says when to come back."""
    headers = {"Retry-After": str(retry_after_seconds), **(exc.headers or {})} if exc.status == 429 else exc.headers
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, headers)


def as_api_error(exc: BaseException) -> APIError:
    """The API error for an engine exception (anything unexpected is a 500, logged by caller)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InputTooLong):
        return APIError(400, str(exc), param="input", code="context_length_exceeded")
    if isinstance(exc, KnobError):
        return APIError(422, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueTimeout):
        return APIError(429, str(exc), "rate_limit_error", code="queue_timeout")  # Retry-After: the handler's
    if isinstance(exc, (EngineClosed, WorkerLost)):
        return APIError(503, str(exc), "service_unavailable", code=type(exc).__name__)
    if isinstance(exc, ModelFailed):
        return APIError(500, str(exc), "server_error")
    return APIError(500, "internal error; see the server log", "server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg', 'invalid')}{more}", param


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return api_error_response(exc, request.app.state.selftune.limits.retry_after_seconds)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        status = 422 if request.url.path.startswith("/admin") else 400
        return error_response(status, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))
