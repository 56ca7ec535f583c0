"""Faults, overload and hostile input against the real server (bounded; long versions: -m slow).

Each test prints its numbers (run with -s to see them).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from helpers import alive, wait_until
from autotune.bench.server import ServerProcess
from test_autotune_live import run_steps

MODEL = "all-MiniLM-L6-v2"
TOKEN = "reliability-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def engine_pids(server) -> tuple[int, list[int]]:
    """(zygote pid, worker pids) under the server process."""
    front = psutil.Process(server.proc.pid)
    zygotes = [c for c in front.children() if "engine.zygote" in " ".join(c.cmdline())]
    assert len(zygotes) == 1
    return zygotes[0].pid, [c.pid for c in zygotes[0].children() if c.status() != psutil.STATUS_ZOMBIE]


def load_while(server, seconds: float, every: float, action) -> list[int]:
    """20 req/s of open-loop load for `seconds` while `action()` runs every `every` seconds."""
    stop = threading.Event()
    errors = []

    def repeat():
        while not stop.wait(every):
            try:
                action()
            except Exception as exc:  # surfaced after the load, not lost in the thread
                errors.append(exc)
                return

    thread = threading.Thread(target=repeat)
    thread.start()
    try:
        return run_steps(server, [(20, seconds)])
    finally:
        stop.set()
        thread.join()
        if errors:
            raise errors[0]


def stats(server) -> dict:
    return httpx.get(server.url + "/stats", timeout=10).json()


@pytest.mark.parametrize("seconds", [pytest.param(8, id="short"), pytest.param(60, id="long", marks=pytest.mark.slow)])
def test_random_killer_every_request_answered_and_workers_come_back(tmp_path, seconds):
    config = {
        "concurrency": {"process_count": 2, "max_batch_size": 8, "batch_timeout": 0.002},
        "supervision": {"crash_loop_deaths": 1000},
        "autotune": {"enabled": False},
    }
    srv = ServerProcess(tmp_path, config)
    rng = random.Random(7)
    kills = []

    def kill_one():
        _, workers = engine_pids(srv)
        if workers:
            victim = rng.choice(workers)
            os.kill(victim, signal.SIGKILL)
            kills.append(victim)

    statuses = load_while(srv, seconds, every=2.5, action=kill_one)
    try:
        print(f"\nrandom killer: {len(kills)} kills in {seconds}s, {len(statuses)} requests, statuses {({s: statuses.count(s) for s in set(statuses)})}")
        assert len(kills) >= seconds // 3
        assert statuses.count(200) == len(statuses)
        wait_until(lambda: stats(srv)["ready_workers"] == 2, timeout=30)
        assert len(engine_pids(srv)[1]) == 2
        s = stats(srv)
        assert s["counters"]["worker_deaths"] == len(kills) and s["counters"]["failed"] == 0
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("seconds", [pytest.param(6, id="short"), pytest.param(60, id="long", marks=pytest.mark.slow)])
def test_retune_storm_fails_nothing_and_leaks_nothing(tmp_path, shm_entries, seconds):
    config = {"concurrency": {"process_count": 2}, "autotune": {"enabled": False}}
    srv = ServerProcess(tmp_path, config, env={"SELFTUNE_ADMIN_TOKEN": TOKEN})
    front = psutil.Process(srv.proc.pid)
    threads_before = front.num_threads()
    fds_before = front.num_fds()
    rng = random.Random(3)
    changes = []
    http = httpx.Client(timeout=30)

    def retune():
        knobs = {
            "process_count": rng.randint(1, 3),
            "threads_per_process": rng.randint(1, 2),
            "io_threads": rng.randint(0, 3),
            "batch_timeout": rng.choice([0.0, 0.001, 0.005, 0.02]),
            "max_batch_size": rng.choice([1, 2, 8, 32]),
        }
        r = http.put(srv.url + "/admin/knobs", json=knobs, headers=AUTH)
        assert r.status_code == 200, r.text
        changes.append(knobs)

    with http:
        statuses = load_while(srv, seconds, every=0.05, action=retune)
    try:
        httpx.put(srv.url + "/admin/knobs", json={"process_count": 2, "io_threads": 2}, headers=AUTH)
        wait_until(lambda: len(stats(srv)["workers"]) == 2 and stats(srv)["ready_workers"] == 2, timeout=30)
        s = stats(srv)
        print(f"\nre-tune storm: {len(changes)} knob changes in {seconds}s, {len(statuses)} requests, "
              f"threads {threads_before}->{front.num_threads()}, fds {fds_before}->{front.num_fds()}")
        assert len(changes) > seconds * 5
        assert statuses.count(200) == len(statuses)
        assert s["counters"]["failed"] == 0 and s["counters"]["worker_deaths"] == 0
        assert len(engine_pids(srv)[1]) == 2
        assert front.num_threads() <= threads_before + 2  # the I/O pool back at 2 threads
        assert front.num_fds() <= fds_before + 4
    finally:
        assert srv.stop() == 0
    assert set(os.listdir("/dev/shm")) == shm_entries


def test_sigkill_of_the_front_process_takes_every_worker_within_5s(tmp_path, shm_entries):
    srv = ServerProcess(tmp_path, {"concurrency": {"process_count": 2}, "autotune": {"enabled": False}})
    zygote, workers = engine_pids(srv)
    httpx.post(srv.url + "/v1/embeddings", json={"model": MODEL, "input": ["warm"] * 8})
    srv.proc.kill()
    srv.proc.wait()
    started = time.monotonic()
    wait_until(lambda: not [p for p in [zygote, *workers] if alive(p)], timeout=5)
    print(f"\nfront SIGKILL: zygote and {len(workers)} workers gone after {time.monotonic() - started:.2f}s")
    assert set(os.listdir("/dev/shm")) == shm_entries


def test_crash_loop_stops_respawning_and_says_why(tmp_path):
    config = {"concurrency": {"process_count": 1}, "supervision": {"crash_loop_deaths": 3, "crash_loop_window_seconds": 60}, "autotune": {"enabled": False}}
    srv = ServerProcess(tmp_path, config)
    try:
        for _ in range(3):
            wait_until(lambda: engine_pids(srv)[1] and stats(srv)["ready_workers"] == 1, timeout=30)
            os.kill(engine_pids(srv)[1][0], signal.SIGKILL)
            wait_until(lambda: stats(srv)["counters"]["worker_deaths"] >= 1)
        wait_until(lambda: stats(srv)["crash_loop"] is not None, timeout=10)
        ready = httpx.get(srv.url + "/readyz")
        assert ready.status_code == 503 and "crash loop" in ready.json()["reason"]
        assert httpx.get(srv.url + "/healthz").status_code == 200
        time.sleep(1.0)  # the backoff is 0.1-0.4 s here: a respawn would have happened by now
        assert engine_pids(srv)[1] == []
        assert "crash loop" in srv.log()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("seconds", [pytest.param(6, id="short"), pytest.param(30, id="long", marks=pytest.mark.slow)])
def test_ten_times_overload_gets_only_200_and_429_and_recovers(tmp_path, seconds):
    config = {
        "concurrency": {"process_count": 2, "max_batch_size": 16, "batch_timeout": 0.002},
        "limits": {"max_queued_requests": 8},  # fewer than the generator's 32 connections
        "autotune": {"enabled": False},
    }
    srv = ServerProcess(tmp_path, config)
    front = psutil.Process(srv.proc.pid)
    try:
        calm = run_steps(srv, [(10, 2)])
        assert calm.count(200) == len(calm)
        rss_before = front.memory_info().rss
        statuses = run_steps(srv, [(1200, seconds)])  # ~10x what two workers serve here
        rss_after = front.memory_info().rss
        recovered_at = time.monotonic()
        latencies = []
        for _ in range(10):
            t = time.perf_counter()
            assert httpx.post(srv.url + "/v1/embeddings", json={"model": MODEL, "input": "calm again"}).status_code == 200
            latencies.append(time.perf_counter() - t)
        print(f"\n10x overload: {len(statuses)} requests in {seconds}s, {statuses.count(200)} x 200, {statuses.count(429)} x 429; "
              f"front RSS {rss_before >> 20} -> {rss_after >> 20} MiB; latency after: max {max(latencies) * 1000:.1f} ms")
        assert set(statuses) <= {200, 429}
        assert statuses.count(429) > statuses.count(200)
        assert rss_after < rss_before + 200 * 2**20
        assert time.monotonic() - recovered_at < 5 and max(latencies) < 0.5
        s = stats(srv)
        assert s["server"]["in_flight"] == 0 and s["pending_requests"] == 0 and s["queue_depth"] == 0
    finally:
        assert srv.stop() == 0


def test_schemathesis_finds_no_server_error(tmp_path):
    config = {
        "concurrency": {"process_count": 1},
        "bounds": {"process_count": {"min": 1, "max": 2}, "threads_per_process": {"min": 1, "max": 2}, "io_threads": {"min": 0, "max": 2}},
        "autotune": {"enabled": False},
    }
    srv = ServerProcess(tmp_path, config, env={"SELFTUNE_ADMIN_TOKEN": TOKEN})  # the admin API is fuzzed too
    try:
        result = subprocess.run(
            [
                os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", srv.url + "/openapi.json",
                "--checks", "not_a_server_error", "--max-examples", "20", "--workers", "1",
                "--phases", "examples,coverage,fuzzing", "--max-time", "25", "--generation-deterministic",
                "--header", f"Authorization: Bearer {TOKEN}",
            ],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,  # its cache dir goes there
        )
        print(result.stdout[-1500:])
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert httpx.get(srv.url + "/healthz").status_code == 200
        assert httpx.post(srv.url + "/v1/embeddings", json={"model": MODEL, "input": "still fine"}).status_code == 200
    finally:
        assert srv.stop() == 0
