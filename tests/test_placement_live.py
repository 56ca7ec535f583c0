"""Placement on this machine: each worker's affinity (from /proc) matches the plan, live."""

from __future__ import annotations

import os

import pytest
from helpers import wait_until

from engine.config import EngineConfig, Knobs
from engine.engine import Engine
from engine.placement import affinity_topology, plan_placement


def allowed_cpus(pid: int) -> set[int]:
    with open(f"/proc/{pid}/status") as f:
        text = next(line for line in f if line.startswith("Cpus_allowed_list:")).split(":")[1].strip()
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def thread_cpus(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def worker_affinities(engine) -> dict[int, set[int]]:
    return {w.worker_id: allowed_cpus(w.pid) for w in engine.stats().workers if w.pid and w.state != "draining"}


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(knobs=Knobs(process_count=2, threads_per_process=1))) as eng:
        eng.wait_ready(workers=2)
        yield eng


def expected(process_count: int, threads: int) -> list[set[int]]:
    plan = plan_placement(affinity_topology(), process_count, threads)
    return [set(w.cpus) for w in plan.workers]


def test_worker_affinity_matches_the_plan(engine):
    got = worker_affinities(engine)
    assert sorted(map(sorted, got.values())) == sorted(map(sorted, expected(2, 1)))
    if len(affinity_topology().cpus) >= 2:
        a, b = got.values()
        assert not a & b  # disjoint cores


def test_affinity_changes_with_the_worker_count_and_every_thread_follows(engine):
    engine.apply(engine.knobs.replace(process_count=1, threads_per_process=2))
    wait_until(lambda: len(engine.stats().workers) == 1)
    engine.embed(["warm the pool of two threads"] * 8).result(timeout=60)
    (pid,) = [w.pid for w in engine.stats().workers]
    want = expected(1, 2)[0]
    wait_until(lambda: allowed_cpus(pid) == want)
    assert all(cpus == want for cpus in thread_cpus(pid))  # the OpenMP threads too
    engine.apply(engine.knobs.replace(process_count=2, threads_per_process=1))
    engine.wait_ready(workers=2)
    wait_until(lambda: sorted(map(sorted, worker_affinities(engine).values())) == sorted(map(sorted, expected(2, 1))))
    stats = engine.stats()
    assert [w["cpus"] for w in stats.placement["workers"]] == [w.cpus for w in sorted(stats.workers, key=lambda w: w.worker_id)]
