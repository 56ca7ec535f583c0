"""The `selftune` command line."""

from __future__ import annotations

import argparse
import logging
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
    serve.add_argument("--policy", help="autotuning policy file (autotune.policy)")
    serve.add_argument("--no-autotune", action="store_true", help="keep the configured knobs; no controller")
    serve.set_defaults(run=run_serve)
    from autotune.bench.cli import register as register_bench
    from autotune.offline_cli import register

    register(commands)
    register_bench(commands)
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
            "autotune.policy": args.policy,
            "autotune.enabled": False if args.no_autotune else None,
        }.items()
        if value is not None
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"selftune: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from autotune.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
