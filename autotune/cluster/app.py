"""The Ray Serve application of selftune: one deployment, replicas that each own a whole engine.

`application(config)` is what `selftune serve --ray` runs; `app_builder` is the same for Ray's
own `serve run` / `serve deploy` (configs/ray/serve.yaml names it).
"""

from __future__ import annotations

from ray import serve

from autotune.cluster.autoscaler import IMPORT_PATH
from autotune.cluster.replica import SelftuneReplica
from autotune.settings import ServerConfig, load_config
from policies.loader import load_replica_policy

DEPLOYMENT = "selftune"


def deployment_options(config: ServerConfig, policy_spec: dict) -> dict:
    c = config.cluster
    return {
        "name": DEPLOYMENT,
        # One replica per node: a replica sizes its workers to the cores it sees, so two on one
        # node would each take the whole node.
        "max_replicas_per_node": 1,
        "ray_actor_options": {"num_cpus": c.replica_cpus or 1},
        # The engine admits and sheds load itself (429 past limits.max_queued_requests); Ray's
        # own cap (5 by default) would queue requests in the proxy where no one tunes for them.
        "max_ongoing_requests": config.limits.max_queued_requests,
        "graceful_shutdown_timeout_s": config.server.shutdown_grace_seconds,
        "health_check_period_s": 5,
        # Ray's per-request access log line costs the replica CPU the engine needs; selftune's
        # own /stats and /metrics count the requests.
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
        "autoscaling_config": {
            "min_replicas": c.min_replicas,
            "max_replicas": c.max_replicas,
            "initial_replicas": c.min_replicas,
            # Deprecated in Ray 2.60 for RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S (set too,
            # by the launcher), but still what Ray checks look_back_period_s against.
            "metrics_interval_s": min(c.interval_seconds, 2.0),
            "look_back_period_s": max(2 * c.interval_seconds, 4.0),
            # The cluster policy has its own stabilization windows; Ray's delays would add to them.
            "upscale_delay_s": 0,
            "downscale_delay_s": 0,
            "policy": {
                "policy_function": IMPORT_PATH,
                "policy_kwargs": {"policy": policy_spec, "source": str(c.policy_path()), "interval_seconds": c.interval_seconds, "audit_log": c.audit_log},
            },
        },
    }


def application(config: ServerConfig):
    """The bound application; the cluster policy file is read (and checked) here, on the driver."""
    import yaml

    path = config.cluster.policy_path()
    load_replica_policy(str(path))  # a bad file stops us here, with the key named
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    replica = serve.deployment(serve.ingress()(SelftuneReplica), **deployment_options(config, spec))
    return replica.bind(config.model_dump(mode="json"))


def app_builder(args: dict):
    """For `serve run autotune.cluster.app:app_builder config=FILE section.key=value ...`."""
    args = dict(args)
    return application(load_config(args.pop("config", None), args))
