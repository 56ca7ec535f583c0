"""The composition root of `selftune serve`: engine + HTTP app + monitors, then uvicorn."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from autotune import dashboard
from autotune.controller import Controller, ControllerConfig
from autotune.guardrails import MachineLimits
from autotune.history import History
from autotune.metrics import Metrics
from autotune.placement_topology import machine_topology
from autotune.settings import ServerConfig
from autotune.telemetry import Telemetry
from engine.engine import Engine
from engine.heap import freeze_startup_heap
from engine.http.app import create_app
from engine.placement import PlacementError, validate_explicit
from monitors.gpu import GpuMonitor
from monitors.topology import read_topology
from policies.loader import PolicyError, load_policy

log = logging.getLogger("selftune")


def build_app(engine: Engine, config: ServerConfig, gpu: GpuMonitor | None = None) -> tuple[FastAPI, Telemetry, Controller | None]:
    """The app for a started engine, with /metrics served and, unless off, the autotuner."""
    telemetry = Telemetry(engine, interval=config.monitors.interval_seconds, window=config.monitors.window_seconds, gpu=gpu)
    app = create_app(
        engine, config.server_limits(), config.admin.token_env, config.server.shutdown_grace_seconds, before_shutdown=telemetry.stop,
        served_names=tuple(config.model.served_names or ()),
    )
    state = app.state.selftune
    telemetry.state = state
    metrics = Metrics(telemetry)
    state.observe = lambda: telemetry.latest.as_dict() if telemetry.latest is not None else None

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    controller = build_controller(engine, config, state) if config.autotune.enabled else None
    history = History(lambda: engine.knobs)
    telemetry.listeners.append(history.on_observation)
    if controller is not None:
        telemetry.listeners.append(controller.on_observation)
    dashboard.install(app, history, config, controller)
    return app, telemetry, controller


def build_controller(engine: Engine, config: ServerConfig, state) -> Controller:
    """The controller for a config; the policy file is read here (a bad one stops start-up)."""
    tune = config.autotune
    path = tune.policy_path()
    limits = MachineLimits(
        usable_cores=len(os.sched_getaffinity(0)),
        allow_oversubscription=tune.allow_oversubscription,
        memory_budget_bytes=tune.memory_budget_bytes,
    )
    controller = Controller(
        engine,
        load_policy(path),
        engine.config.bounds,
        ControllerConfig(
            interval_seconds=tune.interval_seconds,
            cooldown_seconds=tune.cooldown_seconds,
            dry_run=tune.dry_run,
            audit_log=tune.audit_log,
            limits=limits,
        ),
        pinned=lambda: set(state.pinned),
        load_policy=lambda: load_policy(path),
    )
    state.decisions = controller.decisions
    state.reload_policy = controller.reload
    return controller


class StartupError(RuntimeError):
    """The server cannot start; the message says why, `code` is the exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def start_engine(config: ServerConfig) -> tuple[Engine, GpuMonitor]:
    """A started engine for the config (policy file checked first), or StartupError."""
    if config.autotune.enabled:
        try:
            load_policy(config.autotune.policy_path())  # a bad policy file stops us before anything starts
        except PolicyError as exc:
            raise StartupError(str(exc), 2) from None
    try:
        gpu = GpuMonitor()  # one NVML session for the placement plan and the sampler
        engine_config = dataclasses.replace(config.engine_config(), topology=machine_topology(read_topology(), gpu.sample(time.monotonic()).devices))
        if engine_config.placement == "explicit":
            validate_explicit(engine_config.topology, engine_config.placement_cpus, engine_config.knobs.process_count)
    except PlacementError as exc:
        raise StartupError(f"placement.cpus: {exc}", 2) from None
    engine = Engine(engine_config)
    try:
        engine.start()
    except Exception as exc:
        engine.shutdown(grace=0)
        raise StartupError(f"could not start the engine: {exc}", 1) from None
    return engine, gpu


def serve(config: ServerConfig) -> int:
    try:
        engine, gpu = start_engine(config)
    except StartupError as exc:
        print(f"selftune: {exc}", file=sys.stderr)
        return exc.code
    app, telemetry, controller = build_app(engine, config, gpu)
    telemetry.start()
    freeze_startup_heap()
    _print_banner(config, engine, controller)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            timeout_graceful_shutdown=config.server.shutdown_grace_seconds,
            access_log=False,
        ),
        on_hangup=(lambda: setattr(controller, "reload_requested", True)) if controller else None,
        on_drain=lambda: setattr(app.state.selftune, "draining", True),
    )
    try:
        server.run()
    finally:
        telemetry.stop()
        engine.shutdown(grace=0)
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn whose signal handlers only flip state (and do not re-raise on the way out).

    SIGINT / SIGTERM: mark the server draining (503 for new requests and /readyz), stop
    accepting, let in-flight requests finish up to the grace period, then the app's lifespan
    stops the engine; a second Ctrl-C forces.
    SIGHUP: ask the controller to reload its policy file at its next turn.
    """

    def __init__(self, config: uvicorn.Config, on_hangup=None, on_drain=None):
        super().__init__(config)
        self.on_hangup = on_hangup
        self.on_drain = on_drain

    @contextlib.contextmanager
    def capture_signals(self):
        def on_signal(signum, frame):
            if signum == signal.SIGHUP:
                if self.on_hangup is not None:
                    self.on_hangup()
                return
            if self.should_exit and signum == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            if self.on_drain is not None:
                self.on_drain()  # /readyz says 503 and new requests are refused from now on

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _print_banner(config: ServerConfig, engine: Engine, controller: Controller | None) -> None:
    k = engine.knobs
    host = config.server.host
    shown = f"[{host}]" if ":" in host else host
    lines = [
        f"selftune: model {engine.source.name} ({config.model.task}) from {engine.source.path}",
        f"selftune: device {engine.device}, dtype {engine.dtype}",
        f"selftune: knobs process_count={k.process_count} threads_per_process={k.threads_per_process} "
        f"io_threads={k.io_threads} batch_timeout={k.batch_timeout:g}s max_batch_size={k.max_batch_size}",
        f"selftune: autotune {_tuning(config, controller)}",
    ]
    lines += [f"selftune: placement ({config.placement.mode}) {line}" for line in _plan_lines(engine)]
    lines.append(f"selftune: serving on http://{shown}:{config.server.port}  (OpenAI API under /v1; /healthz /readyz /stats /metrics)")
    if _admin_exposed(config):
        lines.append(f"selftune: WARNING the admin API is enabled and {host} is not a loopback address")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _plan_lines(engine: Engine) -> list[str]:
    plan = engine.stats().placement or {"workers": [], "notes": []}
    workers = [f"worker {w['worker']}: cpus {w['cpus']} node {w['node']}" + (f" gpu {w['gpu']}" if w["gpu"] is not None else "") for w in plan["workers"]]
    return workers + [f"note: {n}" for n in plan["notes"]]


def _tuning(config: ServerConfig, controller: Controller | None) -> str:
    if controller is None:
        return "off (the knobs stay as configured)"
    dry = " (dry run: decisions are logged, not applied)" if config.autotune.dry_run else ""
    return f"on, policy {controller.policy.name} from {config.autotune.policy_path()}{dry}"


def _admin_exposed(config: ServerConfig) -> bool:
    if not os.environ.get(config.admin.token_env):
        return False
    try:
        return not ipaddress.ip_address(config.server.host).is_loopback
    except ValueError:
        return config.server.host != "localhost"
