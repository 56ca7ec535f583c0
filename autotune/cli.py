"""The `selftune` command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys

log = logging.getLogger("selftune")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selftune", description="A model-inference server that tunes itself while it serves.")
    parser.add_argument("--version", action="version", version=f"selftune {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API)")
    add_config_options(serve)
    serve.set_defaults(run=run_serve)
    config = commands.add_parser("config", help="the server config: `selftune config show` prints the effective one")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the effective config (YAML), each value with where it came from; "
                                      "takes serve's options")
    add_config_options(show)
    show.set_defaults(run=run_config_show)
    from autotune.bench.cli import register as register_bench
    from autotune.offline.cli import register

    register(commands)
    register_bench(commands)
    args = parser.parse_args(argv)
    return args.run(args)


def version() -> str:
    try:
        return importlib.metadata.version("selftune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def add_config_options(parser) -> None:
    """The options of `serve` that set config keys (also taken by `config show`)."""
    parser.add_argument("--config", help="YAML config file, or builtin:NAME for a shipped one (default: builtin:default)")
    parser.add_argument("--model", help="model directory, builtin:minilm, builtin:smollm2, a .gguf file, or a cached hub name")
    parser.add_argument("--task", choices=["embed", "generate"])
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="model.dtype")
    parser.add_argument("--backend", choices=["auto", "torch", "onnxruntime"], help="model.backend (embeddings)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME", help="names requests may use for the model (model.served_names)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--workers", type=int, help="worker processes (concurrency.process_count)")
    parser.add_argument("--policy", help="autotuning policy file, or builtin:NAME (autotune.policy)")
    parser.add_argument("--no-autotune", action="store_true", help="keep the configured knobs; no controller")
    parser.add_argument("--ray", metavar="auto|local:N", help="serve as replicas on a Ray cluster: auto joins the one at RAY_ADDRESS, "
                        "local:N starts a test cluster of N nodes here, sharing its CPUs out (needs the `ray` extra)")


def config_overrides(args) -> dict:
    """The config keys that the command line sets, {"section.key": value}."""
    return {
        key: value
        for key, value in {
            "model.name": args.model,
            "model.task": args.task,
            "model.dtype": args.dtype,
            "model.backend": args.backend,
            "model.served_names": args.served_model_name,
            "server.host": args.host,
            "server.port": args.port,
            "concurrency.process_count": args.workers,
            "autotune.policy": args.policy,
            "autotune.enabled": False if args.no_autotune else None,
        }.items()
        if value is not None
    }


def run_config_show(args) -> int:
    from autotune.settings import ConfigError, effective_config

    try:
        print(effective_config(args.config, config_overrides(args)), end="")
    except ConfigError as exc:
        print(f"selftune: {exc}", file=sys.stderr)
        return 2
    return 0


def run_serve(args) -> int:
    from autotune.settings import ConfigError, load_config

    try:
        config = load_config(args.config, config_overrides(args))
    except ConfigError as exc:
        print(f"selftune: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "ray", None):
        from autotune.cluster.launch import serve_on_ray

        return serve_on_ray(config, args.ray)
    from autotune.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
