"""GET /dashboard (one page from the package, no CDN) and GET /stats/history (the data behind it).

Both are read-only and need no token: knobs and decisions are not secrets, and nothing here
can change the server. The history is what the sampler already computed (autotune/history.py).
"""

from __future__ import annotations

import os

import yaml
from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from autotune.controller import HOLD
from autotune.history import History, page
from autotune.settings import ServerConfig


def slo_of(policy_path) -> float | None:
    """The tightest `slo_p99_seconds` anywhere in a policy file (composite members included)."""
    try:
        with open(policy_path, encoding="utf-8") as f:
            spec = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "slo_p99_seconds" and isinstance(value, (int, float)):
                    found.append(float(value))
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    return min(found) if found else None


def install(app: FastAPI, history: History, config: ServerConfig, controller) -> None:
    state = app.state.selftune
    engine = state.engine
    tune = config.autotune
    slo_seen: dict = {}  # the file read once per version of it: a reload (SIGHUP) may bring another SLO

    def slo() -> float | None:
        if controller is None:
            return None
        path = tune.policy_path()
        try:
            version = (controller.policy.name, os.stat(path).st_mtime_ns)
        except OSError:
            return None
        if slo_seen.get("version") != version:
            slo_seen.update(version=version, slo=slo_of(path))
        return slo_seen["slo"]

    seconds_kept = history.capacity * config.monitors.interval_seconds
    bounds = engine.config.bounds

    def info() -> dict:
        return {
            "mode": "live",
            "model": engine.source.name,
            "task": engine.config.task,
            "device": engine.device,
            "dtype": engine.dtype,
            "autotune": controller is not None,
            "dry_run": tune.dry_run,
            "policy": controller.policy.name if controller is not None else None,
            "policy_file": str(tune.policy_path()) if controller is not None else None,
            "holding": last_hold(controller),
            "slo_seconds": slo(),
            "bounds": {k: list(getattr(bounds, k)) for k in bounds.__dataclass_fields__},
            "pinned": sorted(state.pinned),
            "interval_seconds": config.monitors.interval_seconds,
            "window_seconds": config.monitors.window_seconds,
        }

    @app.get("/stats/history")
    def stats_history(seconds: float = Query(300.0, gt=0, le=86400), after: float | None = Query(None)):
        """The last `seconds` of points (at most what the ring holds) and the decisions in them;
        with `after` (a point's `t`), only what came later: the page polls that way, so a poll
        costs the same however long the window."""
        points = history.points(seconds)
        if after is not None:
            points = [p for p in points if p["t"] > after]
        start = after if after is not None else (points[0]["t"] if points else float("inf"))
        decisions = list(controller.decisions(1000)) if controller is not None else []
        decisions += list(state.admin_changes)
        decisions = sorted((d for d in decisions if d.get("at") is not None and d["at"] >= start and (after is None or d["at"] > after)),
                           key=lambda d: d["at"])
        return {"info": info(), "kept_seconds": seconds_kept, "points": points, "decisions": decisions}

    @app.get("/dashboard", response_class=HTMLResponse)
    def dashboard():
        return HTMLResponse(page(), headers={"cache-control": "no-cache"})


def last_hold(controller) -> dict | None:
    """The policy's last decision when it was a hold: why the knobs stay, however long ago it was recorded."""
    last = controller.decisions(1) if controller is not None else []
    return {"reason": last[0]["reason"], "time": last[0]["time"]} if last and last[0].get("outcome") == HOLD else None
