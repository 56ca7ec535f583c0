"""The cluster policy: how many replicas, from what the replicas report (pure, no Ray)."""

from __future__ import annotations

import pytest

from policies.loader import PolicyError, load_replica_policy, replica_policy_from_spec
from policies.replicas import ClusterObservation, ReplicaParams, ReplicaPolicy, ReplicaSample

RANGE = (1, 4)


def cluster(t: float, *loads: float, p99: float | None = 0.05, rejected: float = 0.0, queue: float = 0.0, ready: float = 2) -> ClusterObservation:
    return ClusterObservation(
        t, tuple(ReplicaSample(f"r{i}", core_load=load, ready_workers=ready, p99_seconds=p99, rejected_rate=rejected, queue_depth=queue) for i, load in enumerate(loads))
    )


def policy(**params) -> ReplicaPolicy:
    return ReplicaPolicy(ReplicaParams(**params))


def test_scales_up_to_ceil_of_total_load_over_target_after_the_up_window():
    p = policy(target_core_load=0.7, scale_up_stabilization_seconds=4)
    held = p.decide(cluster(0, 1.0), 1, RANGE)
    assert held.replicas == 1 and "held at 1 by scale-up stabilization" in held.reason
    for t in (1, 2, 3):
        p.decide(cluster(t, 1.0), 1, RANGE)
    decision = p.decide(cluster(4, 1.0), 1, RANGE)
    assert decision.replicas == 2
    assert decision.reason == "core load 1.00 > target 0.70 over 1 replicas: replicas 1 -> 2"


def test_one_short_burst_does_not_scale_up():
    p = policy(scale_up_stabilization_seconds=4)
    replicas = 1
    for t, load in enumerate([0.3, 0.3, 1.0, 0.3, 0.3, 0.3]):
        replicas = p.decide(cluster(t, load), replicas, RANGE).replicas
    assert replicas == 1


def test_scale_down_waits_for_the_whole_down_window_and_goes_one_step_at_a_time():
    p = policy(scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=10, max_step_down=1)
    replicas, history = 3, []
    for t in range(40):
        replicas = p.decide(cluster(t, *([0.05] * replicas)), replicas, RANGE).replicas
        history.append(replicas)
    assert history[:10] == [3] * 10  # the first window, seen in full, counts the current count too
    assert history[-1] == 1 and sorted(history, reverse=True) == history
    assert all(a - b <= 1 for a, b in zip(history, history[1:]))


def test_inside_the_tolerance_band_nothing_changes():
    p = policy(target_core_load=0.7, tolerance=0.15, scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=0)
    for t in range(5):
        decision = p.decide(cluster(t, 0.65, 0.75), 2, RANGE)
        assert decision.replicas == 2
    assert "within target" in decision.reason


@pytest.mark.parametrize(
    "pressure, words",
    [(dict(p99=0.9), "p99 900 ms > SLO 500 ms"), (dict(rejected=3.0), "rejects 3.0 req/s"), (dict(queue=500.0), "queue 500 > 100")],
)
def test_an_overloaded_replica_asks_for_one_more_whatever_its_core_load(pressure, words):
    # A core load inside the band (0.7) would hold; latency, rejections or a backlog add one.
    p = policy(scale_up_stabilization_seconds=0, backlog_per_replica=100)
    decision = p.decide(cluster(0, 0.7, 0.7, **pressure), 2, RANGE)
    assert decision.replicas == 3
    assert words in decision.reason


def test_the_range_and_the_step_limit_hold():
    p = policy(scale_up_stabilization_seconds=0, max_step_up=1)
    assert p.decide(cluster(0, 2.0, 2.0), 2, RANGE).replicas == 3  # wants 6: one step
    assert p.decide(cluster(1, 2.0, 2.0, 2.0, 2.0), 4, RANGE).replicas == 4  # at max
    low = policy(scale_down_stabilization_seconds=0)
    assert low.decide(cluster(0, 0.0), 2, (2, 4)).replicas == 2  # at min


def test_replicas_without_a_ready_worker_are_not_counted_and_none_ready_holds():
    p = policy(scale_up_stabilization_seconds=0)
    decision = p.decide(cluster(0, 0.0, ready=0), 2, RANGE)
    assert decision.replicas == 2 and "no replica reports a ready worker" in decision.reason
    # One busy ready replica and one still starting (no ready worker, no load yet): the new one is
    # not read as idle capacity.
    mixed = ClusterObservation(1, (ReplicaSample("a", 1.0, 2), ReplicaSample("b", 0.0, 0)))
    assert p.decide(mixed, 2, RANGE).replicas == 2  # ceil(1.0 / 0.7) = 2: the starting one covers it


def test_the_shipped_cluster_policy_file_loads(tmp_path):
    from autotune import shipped

    loaded = load_replica_policy(str(shipped.builtin(shipped.CLUSTER_POLICY, "replicas")))
    assert loaded.params == ReplicaParams()  # the file shows every default
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: replicas\ntarget_core_load: 0\nmax_replica: 3\n")
    with pytest.raises(PolicyError) as err:
        load_replica_policy(str(bad))
    assert f"{bad}: target_core_load: Input should be greater than 0" in str(err.value)
    assert f"{bad}: max_replica: Extra inputs are not permitted" in str(err.value)
    with pytest.raises(PolicyError, match="kind: a cluster policy file has kind: replicas"):
        replica_policy_from_spec({"kind": "threshold"}, "x.yaml")
