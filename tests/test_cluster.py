"""The Ray layer's own logic, without a cluster: Ray Serve's autoscaling context turned into the
cluster policy's input, the decisions audited, the proxy middleware's retry and typed stream loss,
the deployment's options and the `--ray` argument."""

from __future__ import annotations

import asyncio
import json

import pytest

from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from autotune.cluster.autoscaler import ClusterAutoscaler, cluster_observation
from autotune.cluster.launch import parse_target
from autotune.cluster.proxy_retry import ReplicaLossMiddleware
from autotune.settings import ConfigError, load_config

DEPLOYMENT = DeploymentID(name="selftune", app_name="selftune")
SPEC = {"kind": "replicas", "scale_up_stabilization_seconds": 0, "scale_down_stabilization_seconds": 0}


def context(now: float, target: int, metrics: dict, lo: int = 1, hi: int = 3) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="selftune", app_name="selftune", current_num_replicas=target,
        target_num_replicas=target, running_replicas=[], total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None,
    )


def replica(name: str) -> ReplicaID:
    return ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)


def test_replica_reports_become_the_policys_observation():
    a, b = replica("a"), replica("b")
    metrics = {"core_load": {a: 0.9, b: 0.1}, "ready_workers": {a: 2.0, b: 1.0}, "p99_seconds": {a: 0.2}, "queue_depth": {a: 7.0, b: 0.0}}
    observation = cluster_observation(5.0, metrics)
    assert observation.time == 5.0
    first, second = observation.replicas
    assert (first.replica, first.core_load, first.ready_workers, first.p99_seconds, first.queue_depth) == ("a", 0.9, 2.0, 0.2, 7.0)
    assert (second.replica, second.p99_seconds) == ("b", None)  # nothing finished there: no p99, not a p99 of 0


def test_autoscaler_decides_at_its_interval_audits_and_records(tmp_path):
    audit = tmp_path / "cluster.jsonl"
    recorded = []
    scaler = ClusterAutoscaler(SPEC, "test", interval_seconds=2.0, audit_log=str(audit), record=recorded.append)
    busy = {"core_load": {replica("a"): 1.0}, "ready_workers": {replica("a"): 2.0}}
    target, state = scaler(context(100.0, 1, busy))
    assert target == 2 and state == {}
    assert scaler(context(101.0, 2, {}))[0] == 2  # inside the interval: the last target, no new decision
    assert len(recorded) == 1
    entry = json.loads(audit.read_text().splitlines()[0])
    assert entry["replicas_before"] == 1 and entry["replicas"] == 2 and entry["changed"]
    assert entry["reason"] == "core load 1.00 > target 0.70 over 1 replicas: replicas 1 -> 2"
    assert entry["observed"][0]["replica"] == "a"
    idle = {"core_load": {replica("a"): 0.0, replica("b"): 0.0}, "ready_workers": {replica("a"): 2.0, replica("b"): 2.0}}
    assert scaler(context(102.5, 2, idle))[0] == 1
    assert scaler(context(105.0, 1, idle, lo=1))[0] == 1  # the range's floor
    assert [e["replicas"] for e in recorded] == [2, 1, 1]


def test_a_bad_cluster_policy_spec_stops_the_autoscaler_with_the_key_named():
    with pytest.raises(ValueError, match="cluster.yaml: tolerance: Input should be less than 1"):
        ClusterAutoscaler({"kind": "replicas", "tolerance": 3}, "cluster.yaml")


def asgi_call(app, path: str, body: bytes = b"{}") -> tuple[int, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def scripted_proxy(answers: list[tuple[int, bytes, str]]):
    """Stands for Ray's proxy app: answers the scripted responses in turn, and records what each
    call received (the retried body must be the client's own)."""
    calls = []

    async def app(scope, receive, send):
        message = await receive()
        calls.append(message["body"])
        status, body, content_type = answers[min(len(calls), len(answers)) - 1]
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app, calls


LOST = (500, b"ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.", "text/plain")
OK = (200, b'{"data": []}', "application/json")


def test_embeddings_are_sent_again_when_their_replica_died():
    app, calls = scripted_proxy([LOST, OK])
    status, body = asgi_call(ReplicaLossMiddleware(app, retries=2), "/v1/embeddings", b'{"input": ["x"]}')
    assert (status, body) == (200, b'{"data": []}')
    assert calls == [b'{"input": ["x"]}'] * 2


def test_retries_end_and_other_errors_pass_untouched():
    app, calls = scripted_proxy([LOST])
    assert asgi_call(ReplicaLossMiddleware(app, retries=2), "/v1/embeddings")[0] == 500
    assert len(calls) == 3
    app, calls = scripted_proxy([(500, b'{"error": {"message": "engine error"}}', "application/json"), OK])
    assert asgi_call(ReplicaLossMiddleware(app, retries=2), "/v1/embeddings")[0] == 500  # not a lost replica: not retried
    assert len(calls) == 1
    app, calls = scripted_proxy([LOST, OK])
    assert asgi_call(ReplicaLossMiddleware(app, retries=2), "/v1/completions")[0] == 500  # generation is never replayed
    assert len(calls) == 1


def test_a_stream_that_loses_its_replica_ends_with_a_typed_error_event():
    async def streaming_then_dies(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        raise RuntimeError("ActorDiedError: the replica died")

    status, body = asgi_call(ReplicaLossMiddleware(streaming_then_dies), "/v1/completions")
    events = [json.loads(line[len("data: "):]) for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[0] == {"choices": []}
    assert events[-1]["error"]["type"] == "replica_lost"


@pytest.mark.parametrize("value, nodes", [("auto", None), ("local:2", 2), ("local:1", 1)])
def test_ray_target(value, nodes):
    assert parse_target(value).local_nodes == nodes


@pytest.mark.parametrize("value", ["local", "local:0", "local:x", "ray://x", ""])
def test_bad_ray_target_is_named(value):
    with pytest.raises(ValueError, match="--ray: expected auto or local:N"):
        parse_target(value)


def test_cluster_config_keys_are_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  min_replicas: 3\n  max_replicas: 2\n")
    with pytest.raises(ConfigError, match="min_replicas \\(3\\) is more than max_replicas \\(2\\)"):
        load_config(str(path))
    path.write_text("cluster:\n  policy: builtin:nope\n")
    with pytest.raises(ConfigError, match=f"{path}: cluster.policy: builtin:nope"):
        load_config(str(path))


def test_deployment_owns_its_node_and_leaves_admission_to_the_engine():
    from autotune.cluster.app import deployment_options

    config = load_config(None, {"cluster.min_replicas": 2, "cluster.max_replicas": 5})
    options = deployment_options(config, SPEC)
    assert options["max_replicas_per_node"] == 1
    assert options["max_ongoing_requests"] == config.limits.max_queued_requests
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (2, 5, 2)
    assert scaling["policy"]["policy_function"] == "autotune.cluster.autoscaler:ClusterAutoscaler"
    ClusterAutoscaler(**scaling["policy"]["policy_kwargs"])  # what Ray Serve will call it with


def test_a_stream_cut_short_without_an_exception_also_ends_typed_and_a_whole_one_is_untouched():
    def streamer(chunks):
        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for i, chunk in enumerate(chunks):
                await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

        return app

    cut = [b'data: {"choices": []}\n\n', b""]  # how a proxy may end a stream whose source died
    _, body = asgi_call(ReplicaLossMiddleware(streamer(cut)), "/v1/chat/completions")
    assert body.startswith(b'data: {"choices": []}\n\n') and b'"type": "replica_lost"' in body
    whole = [b'data: {"choices": []}\n\n', b"data: [DO", b"NE]\n\n"]
    _, body = asgi_call(ReplicaLossMiddleware(streamer(whole)), "/v1/chat/completions")
    assert body == b"".join(whole)


def test_a_stream_the_proxy_leaves_open_is_closed_with_the_typed_error():
    async def abandoned(scope, receive, send):  # Ray's proxy, when the replica dies mid-stream
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})

    _, body = asgi_call(ReplicaLossMiddleware(abandoned), "/v1/completions")
    assert body.endswith(b"\n\n") and b'"type": "replica_lost"' in body


def test_no_answer_at_all_counts_as_a_lost_replica_for_embeddings():
    calls = []

    async def silent_then_ok(scope, receive, send):
        calls.append(await receive())
        if len(calls) > 1:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    assert asgi_call(ReplicaLossMiddleware(silent_then_ok), "/v1/embeddings") == (200, b"{}")


def test_node_environment_follows_the_ingress():
    from autotune.cluster.launch import node_environment

    proxy = node_environment(load_config(None, {"cluster.retries": 4, "cluster.interval_seconds": 1}))
    assert proxy["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "autotune.cluster.proxy_retry:middlewares"
    assert proxy["SELFTUNE_RAY_RETRIES"] == "4" and proxy["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "1"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in proxy
    haproxy = node_environment(load_config(None, {"cluster.ingress": "haproxy"}))
    assert haproxy["RAY_SERVE_ENABLE_HA_PROXY"] == haproxy["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert "empty-response" in haproxy["RAY_SERVE_HAPROXY_RETRY_ON"] and "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" not in haproxy


def test_a_bad_ray_target_stops_serve_before_anything_starts():
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--ray", "local:0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ray: expected auto or local:N" in bad.stderr
