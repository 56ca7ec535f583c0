"""The `selftune` command line."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import signal
import sys

log = logging.getLogger("selftune")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selftune", description="A model-inference server that tunes itself while it serves.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API)")
    serve.add_argument("--config", help="YAML config file (default: configs/default.yaml)")
    serve.add_argument("--model", help="model directory, builtin:minilm, builtin:smollm2, a .gguf file, or a cached hub name")
    serve.add_argument("--task", choices=["embed", "generate"])
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=int, help="worker processes (concurrency.process_count)")
    serve.set_defaults(run=run_serve)
    args = parser.parse_args(argv)
    return args.run(args)


def run_serve(args) -> int:
    from autotune.settings import ConfigError, load_config

    overrides = {
        key: value
        for key, value in {
            "model.name": args.model,
            "model.task": args.task,
            "server.host": args.host,
            "server.port": args.port,
            "concurrency.process_count": args.workers,
        }.items()
        if value is not None
    }
    if args.model and not args.task and "smollm2" in args.model:
        overrides["model.task"] = "generate"
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"selftune: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config)


def serve(config) -> int:
    import uvicorn

    from engine.engine import Engine
    from engine.http.app import create_app

    engine = Engine(config.engine_config())
    try:
        engine.start()
    except Exception as exc:
        print(f"selftune: could not start the engine: {exc}", file=sys.stderr)
        return 1
    app = create_app(engine, config.server_limits(), config.admin.token_env, config.server.shutdown_grace_seconds)
    _print_banner(config, engine)
    server = _server_class()(
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
        engine.shutdown(grace=0)
    return 0 if server.started else 1


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn whose signal handlers only flip state (and do not re-raise on the way out).

        SIGINT / SIGTERM: stop accepting, let in-flight requests finish up to the grace
        period, then the app's lifespan drains and stops the engine; a second Ctrl-C forces.
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

    return Server


def _print_banner(config, engine) -> None:
    k = engine.knobs
    host = config.server.host
    shown = f"[{host}]" if ":" in host else host
    lines = [
        f"selftune: model {engine.source.name} ({config.model.task}) from {engine.source.path}",
        f"selftune: device {engine.device}, dtype {engine.dtype}",
        f"selftune: knobs process_count={k.process_count} threads_per_process={k.threads_per_process} "
        f"io_threads={k.io_threads} batch_timeout={k.batch_timeout:g}s max_batch_size={k.max_batch_size}",
        f"selftune: serving on http://{shown}:{config.server.port}  (OpenAI API under /v1, health /healthz, stats /stats)",
    ]
    if _admin_exposed(config):
        lines.append(f"selftune: WARNING the admin API is enabled and {host} is not a loopback address")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _admin_exposed(config) -> bool:
    import os

    if not os.environ.get(config.admin.token_env):
        return False
    try:
        return not ipaddress.ip_address(config.server.host).is_loopback
    except ValueError:
        return config.server.host != "localhost"


if __name__ == "__main__":
    sys.exit(main())
