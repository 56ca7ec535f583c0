"""Runs `selftune bench`: each mode on its own server, the same load and texts for all of them.

Two kinds of load:
- capacity (the default): a rate ladder per mode finds its max QPS within the SLO;
- a workload spec (`autotune/bench/workloads.py`: poisson, step, onoff, mmpp, diurnal, trace):
  the same arrivals and input lengths replayed against every mode, reporting throughput,
  goodput within the SLO and latency percentiles. The simulator takes the same specs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx
import numpy as np

from autotune.bench import loadgen
from autotune.bench.capacity import LadderConfig, RateLadder, StepResult, measure_step
from autotune.bench.modes import Mode, describe
from autotune.bench.server import ServerProcess
from autotune.bench.loadgen import Result
from engine.config import Knobs
from engine.onnx_embedding import served_name

ADMIN_TOKEN = "selftune-bench-admin"
MODEL_NAME = "all-MiniLM-L6-v2"
"""What requests put in "model" (the server serves one model and accepts its name)."""

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    ladder: LadderConfig
    step_seconds: float
    min_judged: int
    """Requests a step judges at least (it runs longer at low rates, up to 3 × step_seconds, so
    a mode that fails down to a few req/s cannot stretch the run): a p99 over 70 requests is
    their maximum, one stall decides it."""
    settle: float
    """Share of each step not judged (the time any server gets to adapt to the new rate)."""
    warmup_seconds: float
    slo: float
    seed: int = 0
    inputs_per_request: int = 1
    """Texts per request (indexing clients send 32-256): rates stay requests/s, the limit is sentences/s."""

    def seconds_at(self, rate: float) -> float:
        """A step's length at `rate`: step_seconds, or longer (at most 3 ×) when that judges fewer than min_judged requests."""
        return min(3 * self.step_seconds, max(self.step_seconds, self.min_judged / ((1 - self.settle) * max(rate, 1e-9))))


@dataclass
class ModeResult:
    mode: str
    description: str
    start_knobs: dict
    final_knobs: dict
    max_qps: float = 0.0
    at_max: dict | None = None
    """The StepResult (as a dict) of the highest passing rate."""
    memory_mib: float = math.nan
    """PSS of all the server's processes, after the run."""
    steps: list[dict] = field(default_factory=list)
    workload: dict | None = None
    """With a workload spec: throughput, goodput, latency percentiles, attainment."""
    timeline: list[dict] = field(default_factory=list)
    """Every second: elapsed time and the knobs the server had."""
    inputs_per_request: int = 1
    dtype: str = ""
    """The dtype its server served (/stats model.dtype: its own start-up choice); empty if not known."""
    decisions: list[dict] = field(default_factory=list)
    """The policy's knob changes with its reasons, and its holds (outcome "no-change", once per reason)
    (GET /admin/decisions), `at` on the log's clock; empty without a policy."""

    @property
    def max_sentences_per_second(self) -> float:
        return self.max_qps * self.inputs_per_request


class RunLog:
    """What a mode's run did over time: the knobs in force (polled from /stats every tick, on
    the load generator's tick thread) and every request, on one clock from the log's start."""

    def __init__(self, url: str):
        self.url = url
        self.rows: list[dict] = []
        self.requests: list[tuple[float, float, bool]] = []
        """(arrival, done, ok) per request, seconds since the log started."""
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._client = httpx.Client(timeout=5)
        self._lock = threading.Lock()

    def tick(self, _elapsed: float) -> None:
        try:
            knobs = self._client.get(self.url + "/stats").json()["knobs"]
        except (httpx.HTTPError, KeyError, ValueError):
            return
        with self._lock:
            self.rows.append({"t": round(time.monotonic() - self.started, 2), **knobs})

    def send(self, arrivals: list[float], body, on_tick=None) -> list[Result]:
        """loadgen.run against the server, the requests kept on this log's clock."""
        offset = time.monotonic() - self.started

        def tick(elapsed: float) -> None:
            self.tick(elapsed)
            if on_tick is not None:
                on_tick(elapsed)

        results = loadgen.run(self.url, arrivals, body, on_tick=tick)
        self.requests.extend((offset + r.sent_at, offset + r.sent_at + r.latency, r.status == 200) for r in results)
        return results

    def decisions(self) -> list[dict]:
        """The controller's decisions (changes, and holds once per reason), `at` in seconds since this log started."""
        try:
            reply = self._client.get(self.url + "/admin/decisions", params={"limit": 10_000},
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).json()
            return [{**d, "at": round(d["time"] - self.started_wall, 2)} for d in reply["decisions"]]
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return []  # the run's numbers stand without the reasons

    def close(self) -> None:
        self._client.close()


def knob_changes(rows: list[dict]) -> list[tuple[float, Knobs]]:
    """[(time, knobs)] at each change of the polled knobs."""
    out: list[tuple[float, Knobs]] = []
    for row in rows:
        knobs = Knobs(**{k: row[k] for k in Knobs.__dataclass_fields__})
        if not out or out[-1][1] != knobs:
            out.append((row["t"], knobs))
    return out


def embed_body(texts: list[str], seed: int, inputs: int = 1) -> Callable[[int], bytes]:
    """Request i embeds one text (or the next `inputs` texts, as a list), in the order of a
    seeded permutation (the same for every mode)."""
    order = np.random.default_rng(seed).permutation(len(texts))
    if inputs == 1:
        chosen = [texts[j] for j in order]
    else:
        chosen = [[texts[order[(k + j) % len(order)]] for j in range(inputs)] for k in range(0, len(order), inputs)]
    bodies = [json.dumps({"model": MODEL_NAME, "input": x, "encoding_format": "base64"}).encode() for x in chosen]
    return lambda i: bodies[i % len(bodies)]


def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Until the server has no request in flight (the previous step drained)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url + "/stats", timeout=5)
            if response.status_code == 404:  # not selftune (a peer under --url): it cannot say; give it a moment
                time.sleep(2.0)
                return
            if response.json()["server"]["in_flight"] == 0:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)


def start_server(mode: Mode, model: str, workdir: str, policy: str | None = None, task: str = "embed") -> ServerProcess:
    return ServerProcess(workdir, mode.server_config(model, policy, task), env={"SELFTUNE_ADMIN_TOKEN": ADMIN_TOKEN})


def capacity(url: str, cpu_seconds: Callable[[], float] | None, log: RunLog, plan: CapacityPlan, texts: list[str], label: str, say: Say, writer=None) -> tuple[float, list[StepResult]]:
    """Warm up at the ladder's first rate, then climb and bisect; (max QPS within SLO, steps)."""
    body = embed_body(texts, plan.seed, plan.inputs_per_request)
    say(f"[{label}] warm-up: {plan.ladder.start:.0f} req/s for {plan.warmup_seconds:g} s")
    warm_up(log, plan.ladder.start, plan.warmup_seconds, body)
    ladder = RateLadder(plan.ladder)
    steps: list[StepResult] = []
    while (rate := ladder.next_rate()) is not None:
        wait_idle(url)
        step, results = measure_step(log.send, rate, plan.seconds_at(rate), plan.settle, plan.slo, body, plan.seed + len(steps), cpu_seconds)
        ladder.record(rate, step.passed)
        steps.append(step)
        if writer is not None:
            write_results(writer, label, rate, results)
        verdict = "pass" if step.passed else "FAIL"
        say(f"[{label}] {rate:6.1f} req/s: p99 {step.p99 * 1000:7.1f} ms, mean {step.mean * 1000:6.1f} ms, "
            f"{step.ok_fraction:6.1%} ok, {step.cpu_cores:.2f} cores -> {verdict}")
    return ladder.best, steps


def warm_up(log: RunLog, rate: float, seconds: float, body) -> None:
    """Requests that are not judged: the first forward passes of a fresh worker are slow."""
    log.send([k / rate for k in range(int(rate * seconds))], body)


def run_mode(
    mode: Mode,
    model: str,
    workdir: str,
    say: Say,
    slo: float,
    plan: CapacityPlan | None = None,
    texts: list[str] = (),
    workload: list[tuple[float, int]] | None = None,
    writer=None,
    policy: str | None = None,
) -> tuple[ModeResult, RunLog]:
    """Start the mode's server, measure it, stop it: its capacity (a `plan` and the `texts`)
    or one workload's arrivals (time, input tokens)."""
    if (plan is None) == (workload is None):
        raise ValueError("run_mode measures either a capacity plan or a workload")
    say(f"[{mode.name}] starting: {mode.description}")
    server = start_server(mode, model, workdir, policy)
    log = RunLog(server.url)
    result = ModeResult(mode.name, mode.description, mode.knobs.as_dict(), {}, inputs_per_request=plan.inputs_per_request if plan else 1)
    try:
        if workload is None:
            result.max_qps, steps = capacity(server.url, server.cpu_seconds, log, plan, texts, mode.name, say, writer)
            result.steps = [s.as_dict() for s in steps]
            best = [s for s in steps if s.passed and s.offered == result.max_qps]
            result.at_max = best[0].as_dict() if best else None
        else:
            warm_up(log, 10.0, 2.0, embed_body(["a few words to warm the workers up"], 0))
            wait_idle(server.url)
            result.workload = replay(log, workload, slo, mode.name, say, writer)
        result.memory_mib = server.memory_bytes() / 2**20
        stats = httpx.get(server.url + "/stats", timeout=10).json()
        model = stats.get("model") or {}
        result.final_knobs, result.dtype = stats["knobs"], served_name(model.get("dtype_choice") or {}) or model.get("dtype") or ""
        result.timeline, result.decisions = log.rows, log.decisions()
    finally:
        log.close()
        server.stop()
    return result, log


def token_bodies(arrivals: list[tuple[float, int]], first_seed: int = 0) -> list[bytes]:
    """One embedding request per arrival (time, input tokens): a seeded text of exactly that many tokens."""
    from autotune.bench.inputs import sentence_of_tokens

    return [json.dumps({"model": MODEL_NAME, "input": sentence_of_tokens(tokens, seed=first_seed + i), "encoding_format": "base64"}).encode()
            for i, (_, tokens) in enumerate(arrivals)]


def replay(log: RunLog, arrivals: list[tuple[float, int]], slo: float, label: str, say: Say, writer=None) -> dict:
    """Send a workload's arrivals (time, input tokens) as one-text embedding requests."""
    bodies = token_bodies(arrivals)
    duration = arrivals[-1][0] if arrivals else 0.0
    results = log.send([t for t, _ in arrivals], lambda i: bodies[i], on_tick=Progress(label, duration, say))
    if writer is not None:
        write_results(writer, label, 0.0, results)
    return summarize(results, duration, slo)


class Progress:
    """A line every ~10 s of a long replay."""

    def __init__(self, label: str, duration: float, say: Say, every: float = 10.0):
        self.label, self.duration, self.say, self.every, self.next = label, duration, say, every, every

    def __call__(self, elapsed: float) -> None:
        if elapsed >= self.next:
            self.next += self.every
            self.say(f"[{self.label}] {elapsed:5.0f} / {self.duration:.0f} s")


def summarize(results: list[Result], duration: float, slo: float) -> dict:
    """Throughput, goodput within the SLO and latency percentiles of a replay."""
    ok = np.array([r.latency for r in results if r.status == 200])
    duration = max(duration, 1e-9)
    good = int(np.sum(ok <= slo)) if len(ok) else 0
    p50, p95, p99 = np.percentile(ok, (50, 95, 99)) if len(ok) else (math.nan,) * 3
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "requests": len(results),
        "statuses": statuses,
        "duration_seconds": round(duration, 3),
        "throughput": len(ok) / duration,
        "throughput_in_window": sum(1 for r in results if r.status == 200 and r.sent_at + r.latency <= duration) / duration,
        "goodput": good / duration,
        "slo_seconds": slo,
        "slo_attainment": good / len(results) if results else 1.0,
        "latency_seconds": {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(ok.mean()) if len(ok) else math.nan},
        "lag_p99_seconds": float(np.percentile([r.lag for r in results], 99)) if results else 0.0,
    }


def write_results(writer, label: str, rate: float, results: list[Result]) -> None:
    for r in results:
        writer.writerow([label, f"{rate:.2f}", f"{r.sent_at:.4f}", r.status, f"{r.latency:.5f}", f"{r.lag:.5f}",
                         *(f"{r.stages[k]:.5f}" if k in r.stages else "" for k in loadgen.STAGE_HEADERS)])


REQUEST_COLUMNS = ["mode", "offered_rate", "sent_at", "status", "latency", "lag", *loadgen.STAGE_HEADERS]


def oracle_sweep(candidates: list[Knobs], model: str, probe_rate: float, probe_seconds: float, slo: float, texts: list[str], seed: int, say: Say,
                 inputs: int = 1) -> tuple[Knobs, list[dict]]:
    """Each static candidate at one rate near capacity on one server (knobs set through the
    admin API); the best is the one with the lowest p99 there (the most headroom), among those
    that answered ≥ 99 % of requests. A rate deep in overload would rank by how a collapsing
    queue behaves, not by the highest rate that meets the SLO."""
    body = embed_body(texts, seed, inputs)
    probe = Mode("oracle-sweep", candidates[0], allow_oversubscription=True)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(probe, model, workdir)
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        try:
            for i, knobs in enumerate(candidates):
                httpx.put(server.url + "/admin/knobs", json=knobs.as_dict(), headers=headers, timeout=30).raise_for_status()
                wait_ready_workers(server.url, knobs.process_count)
                wait_idle(server.url)
                send = lambda arrivals, b: loadgen.run(server.url, arrivals, b)  # noqa: E731
                step, _ = measure_step(send, probe_rate, probe_seconds, 0.4, slo, body, seed, server.cpu_seconds)
                rows.append({"knobs": knobs.as_dict(), "throughput": step.throughput, "p99": step.p99, "ok_fraction": step.ok_fraction})
                say(f"[oracle sweep {i + 1}/{len(candidates)}] {describe(knobs)}: p99 {step.p99 * 1000:.0f} ms, {step.throughput:.1f} req/s at {probe_rate:.0f} offered")
        finally:
            server.stop()
    best = min(rows, key=lambda r: (r["ok_fraction"] < 0.99, r["p99"]))
    return Knobs(**best["knobs"]), rows


def wait_ready_workers(url: str, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stats = httpx.get(url + "/stats", timeout=5).json()
            if stats["ready_workers"] == count and len(stats["workers"]) == count:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{count} workers not ready after {timeout:g} s")


def new_request_log(path: str, columns: list[str] = REQUEST_COLUMNS):
    """A CSV of every request of the run (its file and writer)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    f = open(path, "w", newline="")
    writer = csv.writer(f)
    writer.writerow(columns)
    return f, writer


def as_dict(result: ModeResult) -> dict:
    return {**asdict(result), "max_sentences_per_second": result.max_sentences_per_second}
