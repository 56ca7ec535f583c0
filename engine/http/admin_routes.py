"""The admin API: read, set and pin knobs. Off (403) unless a token is configured.

The token comes from an environment variable (never a config file) and is compared in
constant time. Pinned knobs are left alone by autotuning.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request

from engine.config import KnobError
from engine.http.errors import APIError
from engine.http.schemas import KnobsPatch
from engine.http.state import ServerState


def state_of(request: Request) -> ServerState:
    return request.app.state.selftune


def require_admin(request: Request) -> ServerState:
    state = state_of(request)
    if state.admin_token is None:
        raise APIError(403, f"the admin API is off: set {state.admin_token_env} to enable it", "permission_error")
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not state.admin_token_matches(presented.strip()):
        raise APIError(401, "missing or wrong admin token", "authentication_error", headers={"WWW-Authenticate": "Bearer"})
    return state


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


def _knobs_view(state: ServerState) -> dict:
    return {"knobs": state.engine.knobs.as_dict(), "pinned": sorted(state.pinned)}


@router.get("/knobs")
async def get_knobs(request: Request):
    return _knobs_view(state_of(request))


@router.put("/knobs")
async def put_knobs(patch: KnobsPatch, request: Request):
    state = state_of(request)
    changes = patch.model_dump(exclude_none=True)
    if not changes:
        raise APIError(422, "no knob given; send one or more of " + ", ".join(KnobsPatch.model_fields))
    old = state.engine.knobs
    try:
        new = state.engine.apply(old.replace(**changes))
    except KnobError as exc:
        raise APIError(422, str(exc), param=str(exc).split("=")[0].split(":")[0]) from None
    state.pinned.update(changes)
    said = ", ".join(f"{k} {getattr(old, k)} -> {v}" for k, v in changes.items())
    state.admin_changes.append({"at": round(time.monotonic(), 3), "time": time.time(), "policy": "admin", "outcome": "admin",
                                "reason": f"set through the admin API and pinned: {said}", "old": old.as_dict(), "new": new.as_dict()})
    return _knobs_view(state)


@router.delete("/knobs/pin")
async def unpin_knobs(request: Request, name: str | None = None):
    state = state_of(request)
    if name is None:
        state.pinned.clear()
    elif name in state.pinned:
        state.pinned.discard(name)
    else:
        raise APIError(404, f"knob {name!r} is not pinned", param="name")
    return _knobs_view(state)


@router.get("/decisions")
async def decisions(request: Request, limit: int = Query(100, ge=1, le=10_000)):
    state = state_of(request)
    if state.decisions is None:
        return {"autotune": False, "decisions": []}
    return {"autotune": True, "decisions": state.decisions(limit)}


@router.post("/policy/reload")
async def reload_policy(request: Request):
    state = state_of(request)
    if state.reload_policy is None:
        raise APIError(409, "autotuning is off; there is no policy to reload", code="autotune_off")
    try:
        name = state.reload_policy()
    except ValueError as exc:
        raise APIError(422, f"the policy file was rejected; the running policy stays: {exc}") from None
    return {"policy": name, "reloaded": True}
