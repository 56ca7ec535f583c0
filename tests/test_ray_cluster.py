"""selftune on a real local Ray cluster (ray.cluster_utils.Cluster, two single-CPU nodes here):
one command serves the OpenAI API through Ray Serve, a replica (a whole engine with its own
controller) per node; the cluster policy scales 1 -> 2 -> 1 under a load step; killing a
replica under load loses no embeddings request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import wait_until

from autotune.bench.server import free_port, stop_session

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module", params=["proxy", pytest.param("haproxy", marks=pytest.mark.slow)])
def ray_server(request, tmp_path_factory):
    """`selftune serve --ray local:2`, with each cluster.ingress (HAProxy's is opt-in: -m slow)."""
    tmp = tmp_path_factory.mktemp("ray")
    policy = tmp / "cluster-policy.yaml"
    # Short windows so that the test sees both changes in about a minute.
    policy.write_text("kind: replicas\nscale_up_stabilization_seconds: 2\nscale_down_stabilization_seconds: 6\n")
    audit = tmp / "cluster-audit.jsonl"
    config = tmp / "config.yaml"
    config.write_text(
        "model: {dtype: float32}\n"
        f"cluster: {{min_replicas: 1, max_replicas: 2, interval_seconds: 1, policy: {policy}, audit_log: {audit}, ingress: {request.param}}}\n"
    )
    port = free_port()
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "serve", "--ray", "local:2", "--config", str(config), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or "serving through Ray Serve" in (tmp / "serve.log").read_text(), timeout=240, interval=1)
        assert proc.poll() is None, (tmp / "serve.log").read_text()[-3000:]
        yield url, audit
    finally:
        stop_session(proc)
        log.close()


def cluster_stats(url: str) -> dict:
    return httpx.get(f"{url}/cluster/stats", timeout=30).json()


def test_the_openai_client_works_through_ray_with_one_engine_per_replica(ray_server):
    from openai import OpenAI

    url, _ = ray_server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    result = client.embeddings.create(model=MODEL, input=["a replica owns a node", "and its own engine"])
    assert [len(d.embedding) for d in result.data] == [384, 384]
    stats = wait_until(lambda: (s := cluster_stats(url))["replicas"] and s, timeout=30, interval=0.5)
    (only,) = stats["replicas"]
    assert only["cores"] == 1 and only["policy"]  # one CPU of this machine, and its own controller
    assert only["knobs"]["process_count"] >= 1 and only["node"]
    assert {"max_batch_tokens", "kv_tokens"} <= set(only["knobs"])  # every knob, the generation ones included
    metrics = httpx.get(f"{url}/cluster/metrics", timeout=30).text
    assert "selftune_cluster_replicas 1.0" in metrics
    assert f'selftune_cluster_replica_process_count{{node="{only["node"]}",replica="{only["replica"]}"}}' in metrics


class Load:
    """`clients` closed-loop clients sending 8-sentence embeddings requests; every status kept."""

    def __init__(self, url: str, clients: int):
        self.url, self.statuses, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self):
        body = {"model": MODEL, "input": [f"sentence {i} of a load step on a ray cluster" for i in range(8)]}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                try:
                    r = client.post(f"{self.url}/v1/embeddings", json=body)
                    if r.status_code != 200:
                        self.statuses.append(f"{r.status_code} {r.text[:300]}")
                    else:
                        self.statuses.append(200 if len(r.json()["data"]) == 8 else "200 with a wrong count")
                except httpx.HTTPError as exc:
                    self.statuses.append(repr(exc))

    def end(self) -> list:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
        return self.statuses


@pytest.mark.slow  # ~45 s on 2 cores; the suite keeps the cluster test above (-m slow runs this)
def test_load_step_scales_up_survives_a_killed_replica_and_scales_back(ray_server):
    url, audit = ray_server
    load = Load(url, clients=6)
    try:
        two = wait_until(lambda: len((s := cluster_stats(url))["replicas"]) == 2 and s, timeout=150, interval=1)
        assert {r["node"] for r in two["replicas"]} != 1 and len({r["node"] for r in two["replicas"]}) == 2  # one per node
        victim = two["replicas"][0]
        served_before = len(load.statuses)
        os.kill(victim["pid"], signal.SIGKILL)  # the replica's process: the engine's front
        time.sleep(6)
        assert len(load.statuses) > served_before  # the other replica kept answering
    finally:
        statuses = load.end()
    assert statuses and set(statuses) == {200}, f"{len(statuses)} requests: {sorted(set(map(str, statuses)))}"
    light = Load(url, clients=1)  # a trickle while it scales back down: those must not fail either
    try:
        wait_until(lambda: any(e["replicas_before"] == 2 and e["replicas"] == 1 for e in map(json.loads, audit.read_text().splitlines())), timeout=150, interval=1)
    finally:
        trickle = light.end()
    assert trickle and set(trickle) == {200}
    decisions = [json.loads(line) for line in audit.read_text().splitlines()]
    up = next(e for e in decisions if e["replicas_before"] == 1 and e["replicas"] == 2)
    down = next(e for e in decisions if e["replicas_before"] == 2 and e["replicas"] == 1)
    assert "> target" in up["reason"] or "SLO" in up["reason"]
    assert "< target" in down["reason"] and down["time"] > up["time"]
