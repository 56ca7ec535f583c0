"""The dashboard in a real headless browser (Debian's chromium + chromedriver), under load.

Skipped, with the reason, where no browser is installed (.ci/run installs one). The screenshot
goes to tests/artifacts/dashboard.png (ignored by git).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from autotune.bench.browser import available, headless_chromium as browser
from autotune.bench.server import ServerProcess
from autotune.history import offline_points, report_html
from engine.config import Knobs
from helpers import wait_until

TOKEN = "dashboard-test-token"
MODEL = "all-MiniLM-L6-v2"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
needs_browser = pytest.mark.skipif(not available(), reason="no chromium + chromedriver on PATH (apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {
        "concurrency": {"process_count": 1, "threads_per_process": 1, "max_batch_size": 8},
        "autotune": {"interval_seconds": 1.0, "cooldown_seconds": 1.0},
        "monitors": {"interval_seconds": 0.5, "window_seconds": 5.0},
    }
    srv = ServerProcess(tmp_path_factory.mktemp("dash"), config, env={"SELFTUNE_ADMIN_TOKEN": TOKEN})
    yield srv
    assert srv.stop() == 0, srv.log()


def wait_for(check, timeout: float = 15.0):
    return wait_until(check, timeout=timeout, interval=0.2)  # a page or an HTTP call per look: 5 looks a second


def test_history_is_bounded_and_shows_points_and_admin_changes(server):
    httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]}, timeout=30)
    history = wait_for(lambda: (h := httpx.get(server.url + "/stats/history?seconds=60").json())["points"] and h)

    def latest_point_has_the_knobs_in_force() -> bool:  # within a sampler interval of any change
        return httpx.get(server.url + "/stats/history?seconds=60").json()["points"][-1]["knobs"] == httpx.get(server.url + "/stats").json()["knobs"]

    assert wait_for(latest_point_has_the_knobs_in_force, timeout=5)
    assert history["info"]["autotune"] and history["info"]["policy"] and history["info"]["slo_seconds"] == 0.5
    assert history["kept_seconds"] == 900 * 0.5
    short = httpx.get(server.url + "/stats/history?seconds=1").json()["points"]
    assert 1 <= len(short) <= 4 and short[-1]["t"] - short[0]["t"] <= 1.0
    assert httpx.get(server.url + "/stats/history?seconds=-1").status_code == 400
    assert httpx.post(server.url + "/stats/history").status_code == 405  # read-only


@needs_browser
def test_dashboard_shows_live_knobs_and_an_admin_change_with_its_reason(server):
    stop = threading.Event()

    def load():  # a steady light load, so the page draws real traffic
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                client.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": ["load on the dashboard"]})
                time.sleep(0.02)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    driver = browser()
    try:
        driver.get(server.url + "/dashboard")
        def page_shows_stats(name: str) -> bool:  # the autotuner may move a knob between two looks
            return driver.find_element("id", f"knob-{name}").text == str(httpx.get(server.url + "/stats").json()["knobs"][name])

        for name in ("process_count", "threads_per_process", "io_threads", "max_batch_size"):
            assert wait_for(lambda: page_shows_stats(name), timeout=8), name
        knobs = httpx.get(server.url + "/stats").json()["knobs"]
        assert "live" in driver.find_element("id", "status").text
        assert driver.find_element("id", "model").text == MODEL

        # a knob change through the admin API shows up on the page, with its reason
        target = 5 if knobs["max_batch_size"] != 5 else 6
        put = httpx.put(server.url + "/admin/knobs", json={"max_batch_size": target}, headers={"authorization": f"Bearer {TOKEN}"})
        assert put.status_code == 200
        assert wait_for(lambda: driver.find_element("id", "knob-max_batch_size").text == str(target), timeout=8)
        assert wait_for(lambda: "set through the admin API" in driver.find_element("id", "decisions").text, timeout=8)
        assert f"max_batch_size {knobs['max_batch_size']} → {target}" in driver.find_element("id", "decisions").text
        assert driver.find_element("id", "pin-max_batch_size").text == "pinned"
        paths = driver.find_elements("css selector", "#c-rate path")
        assert paths, "the throughput chart drew no line"
        assert wait_for(lambda: "1" in driver.find_element("id", "workers").text)  # the worker table is filled
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        stop.set()
        driver.quit()
        loader.join(timeout=30)
        httpx.delete(server.url + "/admin/knobs/pin", headers={"authorization": f"Bearer {TOKEN}"})


@needs_browser
def test_a_report_is_the_same_page_with_the_run_inside(tmp_path):
    import numpy as np

    arrival = np.linspace(0, 20, 400)
    done = arrival + np.where(arrival < 10, 0.05, 0.3)
    ok = np.ones(400, bool)
    ok[::50] = False
    changes = [(0.0, Knobs(max_batch_size=4)), (10.0, Knobs(max_batch_size=16))]
    data = {"info": {"mode": "report", "title": "a test run", "model": "m", "task": "embed", "slo_seconds": 0.5, "autotune": True, "policy": "default"},
            "points": offline_points(arrival, done, ok, changes, 20.0),
            "decisions": [{"at": 10.0, "outcome": "applied", "reason": "the batch grew", "old": changes[0][1].as_dict(), "new": changes[1][1].as_dict()},
                          {"at": 15.0, "outcome": "no-change", "reason": "p99 300 ms of 500 ms: holding", "old": changes[1][1].as_dict(), "new": changes[1][1].as_dict()}]}
    assert len(data["points"]) == 20 and data["points"][12]["knobs"]["max_batch_size"] == 16
    assert data["points"][12]["latency"]["total"]["p50"] == pytest.approx(0.3)
    assert data["points"][0]["rejected_rate"] == 1.0  # the request at t=0 was rejected
    path = tmp_path / "report.html"
    path.write_text(report_html(data))
    driver = browser()
    try:
        driver.get(path.as_uri())
        assert driver.find_element("id", "knob-max_batch_size").text == "16"
        assert "the batch grew" in driver.find_element("id", "decisions").text
        # the hold says why the knobs stay, beside the list of changes, not in it
        assert driver.find_element("id", "holding").text == "holding — p99 300 ms of 500 ms: holding"
        assert "holding" not in driver.find_element("id", "decisions").text
        assert "report" in driver.find_element("id", "status").text
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        driver.quit()


def test_a_bench_mode_report_marks_each_knob_change(tmp_path):
    import json
    import re

    from autotune.bench.report import write_mode_report
    from autotune.bench.runner import ModeResult, RunLog

    log = RunLog("http://127.0.0.1:9")  # never contacted: the run's records are filled in by hand
    log.requests = [(i * 0.1, i * 0.1 + 0.05, i % 10 != 0) for i in range(100)]
    log.close()
    knobs = Knobs().as_dict()
    result = ModeResult("autotuned", "", knobs, knobs, timeline=[{"t": 0.0, **knobs}, {"t": 4.0, **{**knobs, "max_batch_size": 32}}])
    path = tmp_path / "report.html"
    write_mode_report(result, log, 0.5, "all-MiniLM-L6-v2", str(path))
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', path.read_text(), re.S).group(1))
    assert data["info"]["title"] == "selftune bench: autotuned" and len(data["points"]) == 10
    assert [d["at"] for d in data["decisions"]] == [4.0] and data["decisions"][0]["new"]["max_batch_size"] == 32
    assert data["points"][0]["rejected_rate"] == 1.0 and data["points"][5]["knobs"]["max_batch_size"] == 32


def test_the_slo_line_is_the_tightest_slo_in_the_policy_file(tmp_path):
    from autotune.dashboard import slo_of

    composite = tmp_path / "composite.yaml"
    composite.write_text("kind: composite\nmembers:\n  - policy: {kind: aimd, slo_p99_seconds: 0.8}\n  - policy: {kind: slo, slo_p99_seconds: 0.3}\n")
    assert slo_of(composite) == 0.3
    (tmp_path / "static.yaml").write_text("kind: static\n")
    assert slo_of(tmp_path / "static.yaml") is None and slo_of(tmp_path / "missing.yaml") is None
