"""The composition root of `selftune serve`: engine + HTTP app + monitors, then uvicorn."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import sys

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from autotune.metrics import Metrics
from autotune.settings import ServerConfig
from autotune.telemetry import Telemetry
from engine.engine import Engine
from engine.http.app import create_app

log = logging.getLogger("selftune")


def build_app(engine: Engine, config: ServerConfig) -> tuple[FastAPI, Telemetry]:
    """The app for a started engine, with the sampler running and /metrics served."""
    telemetry = Telemetry(engine, interval=config.monitors.interval_seconds, window=config.monitors.window_seconds)
    app = create_app(
        engine, config.server_limits(), config.admin.token_env, config.server.shutdown_grace_seconds, before_shutdown=telemetry.stop
    )
    state = app.state.selftune
    telemetry.state = state
    metrics = Metrics(telemetry)
    state.observe = lambda: telemetry.latest.as_dict() if telemetry.latest is not None else None

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app, telemetry


def serve(config: ServerConfig) -> int:
    engine = Engine(config.engine_config())
    try:
        engine.start()
    except Exception as exc:
        print(f"selftune: could not start the engine: {exc}", file=sys.stderr)
        engine.shutdown(grace=0)
        return 1
    app, telemetry = build_app(engine, config)
    telemetry.start()
    _print_banner(config, engine)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            timeout_graceful_shutdown=config.server.shutdown_grace_seconds,
            access_log=False,
        )
    )
    try:
        server.run()
    finally:
        telemetry.stop()
        engine.shutdown(grace=0)
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn whose signal handlers only flip state (and do not re-raise on the way out).

    SIGINT / SIGTERM: stop accepting, let in-flight requests finish up to the grace period,
    then the app's lifespan drains and stops the engine; a second Ctrl-C forces.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        def on_signal(signum, frame):
            if self.should_exit and signum == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _print_banner(config: ServerConfig, engine: Engine) -> None:
    k = engine.knobs
    host = config.server.host
    shown = f"[{host}]" if ":" in host else host
    lines = [
        f"selftune: model {engine.source.name} ({config.model.task}) from {engine.source.path}",
        f"selftune: device {engine.device}, dtype {engine.dtype}",
        f"selftune: knobs process_count={k.process_count} threads_per_process={k.threads_per_process} "
        f"io_threads={k.io_threads} batch_timeout={k.batch_timeout:g}s max_batch_size={k.max_batch_size}",
        f"selftune: serving on http://{shown}:{config.server.port}  (OpenAI API under /v1; /healthz /readyz /stats /metrics)",
    ]
    if _admin_exposed(config):
        lines.append(f"selftune: WARNING the admin API is enabled and {host} is not a loopback address")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _admin_exposed(config: ServerConfig) -> bool:
    if not os.environ.get(config.admin.token_env):
        return False
    try:
        return not ipaddress.ip_address(config.server.host).is_loopback
    except ValueError:
        return config.server.host != "localhost"
