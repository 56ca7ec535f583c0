"""Operations endpoints: liveness, readiness, stats. None of them waits behind inference."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.http.state import ServerState

router = APIRouter()


def state_of(request: Request) -> ServerState:
    return request.app.state.selftune


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/health")
async def health(request: Request):
    """vLLM's and TGI's health check, which benchmark clients probe: 200 when ready (as /readyz)."""
    return await readyz(request)


@router.get("/version")
async def version():
    return {"version": server_version()}


def server_version() -> str:
    """The installed distribution's version (GET /version, the OpenAPI document)."""
    try:
        return importlib.metadata.version("selftune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@router.get("/readyz")
async def readyz(request: Request):
    state = state_of(request)
    stats = state.engine.stats()
    if state.draining:
        return JSONResponse({"status": "draining", "ready_workers": stats.ready_workers}, status_code=503)
    if stats.crash_loop is not None:
        return JSONResponse({"status": "crash loop", "reason": stats.crash_loop, "ready_workers": stats.ready_workers}, status_code=503)
    if stats.ready_workers < 1:
        return JSONResponse({"status": "no ready worker", "ready_workers": 0}, status_code=503)
    return {"status": "ready", "ready_workers": stats.ready_workers}


@router.get("/stats")
async def stats(request: Request):
    state = state_of(request)
    engine = state.engine
    snapshot = engine.stats().as_dict()
    snapshot["model"] = {
        "name": engine.source.name,
        "task": engine.config.task,
        "device": engine.device,
        "dtype": engine.dtype,
        # how model.dtype was resolved: requested, dtype, reason, native_bf16, min_cosine (worst
        # cosine to fp32 on the probe set), bf16_speedup...; None if the engine does not say
        "dtype_choice": engine.dtype_choice,
        # how `max_batch_tokens: auto` was measured at start-up (per_thread, reason, step times); None if it was not
        "batch_tokens_choice": engine.batch_tokens_choice,
    }
    snapshot["pinned"] = sorted(state.pinned)
    snapshot["server"] = {
        "in_flight": state.admission.current,
        "rejected": state.admission.rejected,
        "timed_out": state.timed_out,
        "queue_timeout_seconds": engine.config.queue_timeout,
        "draining": state.draining,
    }
    snapshot["observation"] = state.observe() if state.observe is not None else None
    return snapshot
