"""The FastAPI application in front of a running engine."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI

from engine.engine import Engine
from engine.http import admin_routes, completions, errors, openai_routes, ops_routes, tokenize_routes
from engine.http.fast_path import EmbeddingsFastPath
from engine.http.limits import BodySizeLimit
from engine.http.state import ServerLimits, ServerState
from engine.http.timing import RequestTiming


class SelftuneAPI(FastAPI):
    """FastAPI whose embedding requests meet `EmbeddingsFastPath` before any of its layers."""

    fast_path: EmbeddingsFastPath

    async def __call__(self, scope, receive, send) -> None:
        await self.fast_path(scope, receive, send)


def create_app(
    engine: Engine,
    limits: ServerLimits = ServerLimits(),
    admin_token_env: str = "SELFTUNE_ADMIN_TOKEN",
    shutdown_grace: float = 30.0,
    before_shutdown: Callable[[], None] | None = None,
    served_names: tuple[str, ...] = (),
) -> SelftuneAPI:
    """An app serving `engine` (already started); shutting the app down shuts the engine down.

    `before_shutdown` runs first (e.g. stopping whoever reads the engine in the background).
    """
    state = ServerState(engine, limits, admin_token_env, tuple(served_names))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.draining = True
        if before_shutdown is not None:
            before_shutdown()
        engine.shutdown(grace=shutdown_grace)

    app = SelftuneAPI(title="selftune", version=ops_routes.server_version(), lifespan=lifespan)
    app.fast_path = EmbeddingsFastPath(lambda scope, receive, send: FastAPI.__call__(app, scope, receive, send), state)
    app.state.selftune = state
    errors.install(app)
    app.include_router(openai_routes.router)
    app.include_router(completions.router)
    app.include_router(tokenize_routes.router)
    app.include_router(ops_routes.router)
    app.include_router(admin_routes.router)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(RequestTiming, latency=engine.latency)
    return app
