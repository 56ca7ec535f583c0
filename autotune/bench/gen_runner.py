"""Runs `selftune bench --task generate`: each mode on its own generating server, the same streamed requests for all.

A rate ladder per mode (autotune/bench/capacity.py's `RateLadder`) finds the highest Poisson
rate at which a step passes `judge_generation` (both p99 objectives, nothing failed); each step
is cut `grace` seconds after its last arrival. The oracle probes a grid of static knobs at one
rate on one server, as the embedding bench does. With a workload instead of the ladder, each
mode replays the same arrivals once and the whole replay is judged as one step (its goodput).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np

from autotune.bench import stream_loadgen
from autotune.bench.capacity import LadderConfig, RateLadder, poisson_arrivals
from autotune.bench.gen_capacity import GenStepResult, judge_generation
from autotune.bench.modes import Mode, describe
from autotune.bench.runner import ADMIN_TOKEN, ModeResult, Progress, RunLog, start_server, wait_idle, wait_ready_workers
from autotune.bench.stream_loadgen import StreamResult
from engine.config import Knobs

Say = Callable[[str], None]
Body = Callable[[int], bytes]


@dataclass(frozen=True, slots=True)
class GenPlan:
    ladder: LadderConfig
    step_seconds: float
    min_judged: int
    """Requests a step judges at least (it runs longer at low rates, up to `longest` × step_seconds)."""
    settle: float
    """Share of each step not judged (the time any server gets to adapt to the new rate)."""
    warmup_seconds: float
    ttft_slo: float
    itl_slo: float
    grace: float
    """Seconds after a step's last arrival that its open streams are cut; ≥ ttft_slo, so a
    request cut before its first token has already missed the TTFT objective."""
    path: str = "/v1/completions"
    seed: int = 0
    longest: float = 3.0
    """A step lasts at most this many × step_seconds, however few requests it judges then."""

    def seconds_at(self, rate: float) -> float:
        """A step's length at `rate`: step_seconds, or longer (at most `longest` ×) when that judges fewer than min_judged requests."""
        return min(self.longest * self.step_seconds, max(self.step_seconds, self.min_judged / ((1 - self.settle) * max(rate, 1e-9))))


class GenRunLog(RunLog):
    """A mode's run: knobs and running sequences polled from /stats, every request on one clock.

    `requests` holds (arrival, arrival + TTFT, answered), so the timeline and the dashboard
    report draw time to first token over the run."""

    def __init__(self, url: str):
        super().__init__(url)
        self.last_offset = 0.0

    def tick(self, _elapsed: float) -> None:
        try:
            stats = self._client.get(self.url + "/stats").json()
            knobs = stats["knobs"]
        except (httpx.HTTPError, KeyError, ValueError):
            return
        running = sum(w.get("running_sequences", 0) for w in stats.get("workers", ()))
        with self._lock:
            self.rows.append({"t": round(time.monotonic() - self.started, 2), **knobs, "running": running})

    def stream(self, arrivals: list[float], body: Body, path: str, cut_after: float | None = None,
               progress: Callable[[float], None] | None = None) -> list[StreamResult]:
        """stream_loadgen.run against the server, /stats polled meanwhile (and `progress` told the
        seconds elapsed), the requests kept on this log's clock."""
        self.last_offset = offset = time.monotonic() - self.started
        tick = self.tick if progress is None else lambda elapsed: (self.tick(elapsed), progress(elapsed))
        results = stream_loadgen.run(self.url, arrivals, body, path, cut_after, on_tick=tick)
        self.requests.extend((offset + r.sent_at, offset + r.sent_at + (r.ttft if r.ok else 0.0), r.ok and not math.isnan(r.ttft))
                             for r in results)
        return results

    def running_between(self, t0: float, t1: float) -> float:
        """Mean sequences running (all workers) in the polls between t0 and t1 (log clock); NaN without any."""
        with self._lock:
            values = [r["running"] for r in self.rows if t0 <= r["t"] <= t1 and "running" in r]
        return float(np.mean(values)) if values else math.nan


def measure_gen_step(log: GenRunLog, rate: float, plan: GenPlan, body: Body, seed: int, cpu_seconds: Callable[[], float] | None = None,
                     seconds: float | None = None, settle: float | None = None) -> tuple[GenStepResult, list[StreamResult]]:
    """Offer `rate` req/s (Poisson, its count fixed in both parts) for the plan's step length; judge the part after the settling share."""
    seconds = plan.seconds_at(rate) if seconds is None else seconds
    settle = plan.settle if settle is None else settle
    arrivals = poisson_arrivals(rate, seconds, seed, settle * seconds)
    cpu0, t0 = (cpu_seconds() if cpu_seconds else 0.0), time.monotonic()
    results = log.stream(arrivals, body, plan.path, cut_after=seconds + plan.grace)
    wall = time.monotonic() - t0
    cores = (cpu_seconds() - cpu0) / wall if cpu_seconds else math.nan
    running = log.running_between(log.last_offset + settle * seconds, log.last_offset + seconds)
    return judge_generation(results, rate, settle * seconds, seconds, plan.ttft_slo, plan.itl_slo, cores, running), results


def warm_up(log: GenRunLog, plan: GenPlan, body: Body, label: str, say: Say) -> None:
    """Evenly spaced requests at the ladder's first rate for the plan's warm-up seconds (nothing judged)."""
    say(f"[{label}] warm-up: {plan.ladder.start:.2f} req/s for {plan.warmup_seconds:g} s")
    warm = plan.ladder.start
    log.stream([k / warm for k in range(max(1, int(warm * plan.warmup_seconds)))], body, plan.path, cut_after=plan.warmup_seconds + plan.grace)


def generation_capacity(url: str, cpu_seconds: Callable[[], float] | None, log: GenRunLog, plan: GenPlan, body: Body, label: str, say: Say,
                        writer=None) -> tuple[float, list[GenStepResult]]:
    """Warm up at the ladder's first rate, then climb and bisect; (max req/s within both objectives, steps)."""
    warm_up(log, plan, body, label, say)
    ladder = RateLadder(plan.ladder)
    steps: list[GenStepResult] = []
    while (rate := ladder.next_rate()) is not None:
        wait_idle(url)
        step, results = measure_gen_step(log, rate, plan, body, plan.seed + len(steps), cpu_seconds)
        ladder.record(rate, step.passed)
        steps.append(step)
        if writer is not None:
            write_gen_results(writer, label, rate, results)
        say(f"[{label}] {rate:5.2f} req/s: TTFT p99 {step.ttft_p99 * 1000:6.0f} ms, ITL p99 {step.itl_p99 * 1000:5.0f} ms, "
            f"{step.output_tokens_per_s:6.1f} tok/s, {step.failed} failed, {step.cut} cut of {step.judged}, "
            f"{step.running:4.1f} running, {step.cpu_cores:.2f} cores -> {'pass' if step.passed else 'FAIL'}")
    return ladder.best, steps


def replay_generation(log: GenRunLog, arrivals: list[float], plan: GenPlan, body: Body, label: str, say: Say, writer=None,
                      cpu_seconds: Callable[[], float] | None = None) -> GenStepResult:
    """Stream request i at arrivals[i] (seconds), cut `grace` after the last; the whole replay judged as one step."""
    duration = max(arrivals[-1] if arrivals else 0.0, 1e-9)
    cpu0, t0 = (cpu_seconds() if cpu_seconds else 0.0), time.monotonic()
    results = log.stream(arrivals, body, plan.path, cut_after=duration + plan.grace, progress=Progress(label, duration, say))
    cores = (cpu_seconds() - cpu0) / (time.monotonic() - t0) if cpu_seconds else math.nan
    running = log.running_between(log.last_offset, log.last_offset + duration)
    step = judge_generation(results, len(arrivals) / duration, 0.0, duration, plan.ttft_slo, plan.itl_slo, cores, running)
    if writer is not None:
        write_gen_results(writer, label, step.offered, results)
    say(f"[{label}] replayed {step.judged} requests over {duration:.0f} s: goodput {step.goodput:.3f} req/s, TTFT p99 {step.ttft_p99 * 1000:.0f} ms, "
        f"ITL p99 {step.itl_p99 * 1000:.0f} ms, {step.failed} failed, {step.cut} cut")
    return step


def run_gen_mode(mode: Mode, model: str, workdir: str, say: Say, plan: GenPlan, body: Body, writer=None, policy: str | None = None,
                 workload: list[float] | None = None) -> tuple[ModeResult, GenRunLog]:
    """Start the mode's generating server, find its capacity (or replay the workload's arrivals), stop it."""
    say(f"[{mode.name}] starting: {mode.description}")
    server = start_server(mode, model, workdir, policy, task="generate")
    log = GenRunLog(server.url)
    result = ModeResult(mode.name, mode.description, mode.knobs.as_dict(), {})
    try:
        if workload is None:
            result.max_qps, steps = generation_capacity(server.url, server.cpu_seconds, log, plan, body, mode.name, say, writer)
            result.steps = [s.as_dict() for s in steps]
            best = [s for s in steps if s.passed and s.offered == result.max_qps]
            result.at_max = best[0].as_dict() if best else None
        else:
            warm_up(log, plan, body, mode.name, say)
            wait_idle(server.url)
            result.workload = replay_generation(log, workload, plan, body, mode.name, say, writer, server.cpu_seconds).as_dict()
        result.memory_mib = server.memory_bytes() / 2**20
        result.final_knobs = httpx.get(server.url + "/stats", timeout=10).json()["knobs"]
        result.timeline, result.decisions = log.rows, log.decisions()
    finally:
        log.close()
        server.stop()
    return result, log


def gen_oracle_sweep(candidates: list[Knobs], model: str, probe_rate: float, probe_seconds: float, plan: GenPlan, body: Body, say: Say,
                     queue_timeout: float | None = None) -> tuple[Knobs, list[dict]]:
    """Each static candidate at one rate near capacity on one server (knobs set through the
    admin API); the best is the one with the most headroom there: no failure, then the lowest
    of max(TTFT p99 / objective, ITL p99 / objective)."""
    probe = Mode("oracle-sweep", candidates[0], allow_oversubscription=True, queue_timeout=queue_timeout)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(probe, model, workdir, task="generate")
        log = GenRunLog(server.url)
        try:
            for i, knobs in enumerate(candidates):
                httpx.put(server.url + "/admin/knobs", json=knobs.as_dict(), headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30).raise_for_status()
                wait_ready_workers(server.url, knobs.process_count)
                wait_idle(server.url)
                step, _ = measure_gen_step(log, probe_rate, plan, body, plan.seed, server.cpu_seconds, seconds=probe_seconds, settle=0.4)
                share = max(step.ttft_p99 / plan.ttft_slo, step.itl_p99 / plan.itl_slo)
                rows.append({"knobs": knobs.as_dict(), "failed": step.failed, "share_of_objective": share, "ttft_p99": step.ttft_p99,
                             "itl_p99": step.itl_p99, "output_tokens_per_s": step.output_tokens_per_s})
                say(f"[oracle sweep {i + 1}/{len(candidates)}] {describe(knobs)}: TTFT p99 {step.ttft_p99 * 1000:.0f} ms, "
                    f"ITL p99 {step.itl_p99 * 1000:.0f} ms, {step.output_tokens_per_s:.1f} tok/s at {probe_rate:.2f} req/s offered")
        finally:
            log.close()
            server.stop()
    best = min(rows, key=lambda r: (r["failed"] > 0, r["share_of_objective"] if math.isfinite(r["share_of_objective"]) else math.inf, -r["output_tokens_per_s"]))
    return Knobs(**best["knobs"]), rows


GEN_REQUEST_COLUMNS = ["mode", "offered_rate", "sent_at", "status", "ttft", "latency", "lag", "output_tokens", "prompt_tokens",
                       "itl_mean", "itl_max", "cut_at", "error"]


def write_gen_results(writer, label: str, rate: float, results: list[StreamResult]) -> None:
    for r in results:
        gaps = r.itls()
        writer.writerow([label, f"{rate:.3f}", f"{r.sent_at:.4f}", r.status, f"{r.ttft:.5f}", f"{r.latency:.5f}", f"{r.lag:.5f}",
                         r.output_tokens, r.prompt_tokens or "", f"{gaps.mean():.5f}" if len(gaps) else "", f"{gaps.max():.5f}" if len(gaps) else "",
                         f"{r.cut_at:.4f}" if not math.isnan(r.cut_at) else "", r.error])
