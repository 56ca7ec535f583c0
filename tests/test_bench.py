"""`selftune bench`'s parts: the rate ladder, step judging, modes, the load generator, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from autotune.bench import loadgen
from autotune.bench.capacity import LadderConfig, RateLadder, judge, poisson_arrivals
from autotune.bench.cli import verdicts
from autotune.bench.echo import generator_check
from autotune.bench.limit import limit_at_batch, measure_limit
from autotune.bench.modes import SEED_DEFAULTS, SHIPPED, mode, oracle_candidates
from autotune.bench.runner import CapacityPlan, ModeResult, RunLog, capacity
from autotune.bench.server import ServerProcess
from autotune.bench.loadgen import Result


def climb(capacity_rps: float, config: LadderConfig) -> tuple[float, list[float]]:
    """Run the ladder against a server that passes exactly the rates <= capacity_rps."""
    ladder = RateLadder(config)
    offered = []
    while (rate := ladder.next_rate()) is not None:
        offered.append(rate)
        ladder.record(rate, rate <= capacity_rps)
    return ladder.best, offered


def test_ladder_climbs_geometrically_then_bisects():
    best, offered = climb(100.0, LadderConfig(start=40, factor=1.5, refine=2))
    assert offered[:4] == [40, 60, 90, 135]
    assert offered[4:] == [112.5, 101.25]  # between the last pass (90) and the first fail (135), twice
    assert best == 90.0


def test_ladder_best_is_the_highest_pass_below_the_lowest_failure():
    ladder = RateLadder(LadderConfig(start=10, factor=2, refine=1))
    for rate, ok in [(10, True), (20, True), (40, False), (30, False)]:
        ladder.record(rate, ok)
    assert ladder.best == 20
    assert ladder.next_rate() is None  # one bisection (30) done


def test_ladder_steps_down_when_even_the_first_rate_fails():
    best, offered = climb(12.0, LadderConfig(start=40, factor=2, refine=1))
    assert offered[:3] == [40, 10, 25]  # down by factor², then bisect between 10 and 40
    assert best == 10
    assert climb(0.1, LadderConfig(start=4, factor=2, refine=1))[0] == 0.0  # gives up below min_rate


def test_steps_run_longer_at_low_rates_to_judge_enough_requests():
    from autotune.bench.runner import CapacityPlan

    plan = CapacityPlan(LadderConfig(start=10), step_seconds=12.0, min_judged=200, settle=1 / 3, warmup_seconds=8.0, slo=0.5)
    assert plan.seconds_at(100.0) == 12.0  # 800 judged already
    assert plan.seconds_at(10.0) == pytest.approx(30.0)  # 200 judged over the last two thirds
    assert plan.seconds_at(10.0) * (1 - plan.settle) * 10.0 == pytest.approx(200)
    assert plan.seconds_at(2.0) == 36.0  # at most 3 × step_seconds: a mode failing down to 2 req/s does not stretch the run


def test_judge_skips_the_settling_part_and_needs_the_p99_and_the_200s():
    fast = [Result(t / 10, 200, 0.05) for t in range(100)]
    slow_start = [Result(t / 10, 200, 2.0 if t < 30 else 0.05) for t in range(100)]
    assert judge(fast, 10, 0.0, 10, slo=0.5, cpu_cores=1.0).passed
    assert not judge(slow_start, 10, 0.0, 10, slo=0.5, cpu_cores=1.0).passed
    assert judge(slow_start, 10, 3.0, 10, slo=0.5, cpu_cores=1.0).passed
    late = [Result(t / 10, 200, 5.0) for t in range(100)]  # all answered, but after the step: not throughput
    assert judge(late, 10, 0.0, 10, slo=10.0, cpu_cores=1.0).throughput == pytest.approx(5.1)
    rejected = [Result(t / 10, 429 if t % 20 == 0 else 200, 0.05) for t in range(100)]
    step = judge(rejected, 10, 0.0, 10, slo=0.5, cpu_cores=1.0)
    assert not step.passed and step.ok_fraction == pytest.approx(0.95)


def test_judge_averages_the_batch_size_over_forward_passes_not_requests():
    # one pass of 8 (reported by its 8 requests) and 8 passes of 1: 9 passes, 16 items
    results = [Result(i / 10, 200, 0.05, batch=(8, 1, 40)) for i in range(8)] + [Result(1 + i / 10, 200, 0.05, batch=(1, 1, 12)) for i in range(8)]
    assert judge(results, 10, 0.0, 10, slo=0.5, cpu_cores=1.0).batch_items == pytest.approx(16 / 9)
    assert math.isnan(judge([Result(0.0, 200, 0.05)], 10, 0.0, 10, slo=0.5, cpu_cores=1.0).batch_items)


def test_limit_at_a_batch_size_interpolates_the_best_layout():
    table = {"1x2": {"1": 90.0, "8": 150.0, "16": 180.0, "64": 200.0}, "2x1": {"1": 140.0, "8": 160.0, "16": 160.0, "64": 230.0}}
    assert limit_at_batch(table, 12) == pytest.approx(165.0)  # 1x2 between 8 and 16 beats 2x1's flat 160
    assert limit_at_batch(table, 40) == pytest.approx(195.0)  # 2x1: 160 + (230 - 160) / 2
    assert limit_at_batch(table, 1) == pytest.approx(140.0)
    assert limit_at_batch({"2x1": {1: 100.0, 64: 300.0}}, 200) == pytest.approx(300.0)  # no extrapolation


@pytest.mark.slow  # ~60 s: two full limit sweeps; the suite passed 15 min with it (opt in: -m slow)
def test_measure_limit_measures_the_served_backend_and_fp32_and_the_winning_cells_again():
    from conftest import minilm_dir

    lines = []
    texts = [f"sentence {i} for the limit" for i in range(40)]
    limits = measure_limit(minilm_dir(), texts, cores=2, batch_sizes=(1, 4), duration=0.3, say=lines.append, dtype="bfloat16")
    assert limits.choice["dtype"] == limits.best.dtype == "bfloat16" and limits.choice["requested"] == "bfloat16"
    assert limits.float32.dtype == "float32" and limits.float32 is not limits.best
    for limit in (limits.best, limits.float32):
        assert set(limit.table) == {"1x2", "2x1"} and all(set(row) == {1, 4} for row in limit.table.values())
        assert limit.swept == max(v for row in limit.table.values() for v in row.values())
        assert limit.swept == limit.table[f"{limit.processes}x{limit.threads}"][limit.batch_size]
        assert limit.sentences_per_second > 0
        assert any(f"{limit.dtype}, batch {limit.batch_size}, again for 0.9 s: {limit.sentences_per_second:.0f}/s (halves" in line for line in lines)
    assert sum(" bfloat16: batch 1:" in line for line in lines) == sum(" float32: batch 1:" in line for line in lines) == 2


def test_the_limit_follows_the_servers_choice_without_native_bf16(monkeypatch):
    from conftest import minilm_dir

    from autotune.bench.limit import served_choice
    from engine.loading import NATIVE_BF16_ENV

    monkeypatch.setenv(NATIVE_BF16_ENV, "0")  # the spawned child inherits it: a CPU without avx512_bf16/AMX
    choice = served_choice(minilm_dir(), "auto")
    assert choice["dtype"] == "float32" and "no native bf16" in choice["reason"]


def test_the_limit_row_and_verdicts_name_the_served_backend_and_fp32_beside_it():
    from autotune.bench.report import capacity_table

    fp32 = {"sentences_per_second": 100.0, "processes": 2, "threads": 1, "batch_size": 64, "dtype": "float32", "table": {"2x1": {"1": 60.0, "64": 100.0}}}
    limit = {**fp32, "sentences_per_second": 180.0, "batch_size": 32, "dtype": "bfloat16", "mode": "bf16-mixed",
             "table": {"2x1": {"1": 90.0, "32": 180.0}}, "float32": fp32}
    best = ModeResult("multiprocess", "", {}, {}, max_qps=135.0, at_max={})
    table = capacity_table([best], limit, 0.5).splitlines()
    assert table[-2].startswith("| limit | in-process, no server, bfloat16 (bf16-mixed), the backend the server serves: 2 × 1, batch 32 | **180** |")
    assert table[-1].startswith("| limit, fp32 | in-process, no server, float32, for comparison: 2 × 1, batch 64 | **100** |")
    lines = verdicts([best], limit)
    assert lines[0] == "best served mode multiprocess: 135 req/s = 0.75 × limit (180/s, bfloat16 (bf16-mixed): the backend the server serves)"
    assert lines[1] == "fp32 limit 100/s: the served backend's limit is 1.80 × it; best served = 1.35 × the fp32 limit"
    assert capacity_table([best], fp32, 0.5).splitlines()[-1].startswith("| limit | in-process, no server, float32, the backend")  # fp32 served: one row
    best.dtype = "float32"  # a server whose own probe chose fp32 (a busy machine can make bf16 measure slower)
    assert "| multiprocess | , float32 | **135** |" in capacity_table([best], limit, 0.5)
    assert verdicts([best], limit)[1] == "note: multiprocess's server served float32, the limit is bfloat16's: its start-up probe chose otherwise"


def test_verdicts_set_the_best_mode_against_the_limit_at_the_batch_it_ran():
    limit = {"sentences_per_second": 200.0, "table": {"2x1": {"1": 100.0, "16": 150.0, "64": 200.0}}}
    best = ModeResult("autotuned", "", {}, {}, max_qps=140.0, at_max={"batch_items": 16.0})
    other = ModeResult("multiprocess", "", {}, {}, max_qps=120.0, at_max={})
    lines = verdicts([other, best], limit)
    assert lines[0] == "best served mode autotuned: 140 req/s = 0.70 × limit (200/s)"
    assert lines[1] == "at the batch size it ran at that rate (16.0 items per forward), the in-process limit is 150/s: 0.93 × that"
    assert "at the batch size" not in " ".join(verdicts([best.__class__("autotuned", "", {}, {}, max_qps=140.0, at_max={})], limit))
    level = ModeResult("multithread", "", {"process_count": 1}, {}, max_qps=140.0, at_max={"p99": 0.31})
    assert lines[-1] == "autotuned ahead of: multiprocess"
    assert verdicts([other, level, best], None)[-1] == "autotuned ahead of: multiprocess; not ahead of: multithread (140 vs 140, +0%)"
    best.at_max["p99"] = 0.25
    oracle = ModeResult("oracle", "", {"process_count": 1}, {}, max_qps=140.0)
    assert verdicts([other, level, best, oracle], None)[-1] == (
        "autotuned ahead of: multiprocess; not ahead of: multithread (140 vs 140, +0%; p99 there 250 vs 310 ms; the oracle's sweep chose this configuration)")


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = poisson_arrivals(50, 20, seed=3)
    assert a == poisson_arrivals(50, 20, seed=3) and a != poisson_arrivals(50, 20, seed=4)
    assert all(0 <= t < 20 for t in a) and a == sorted(a)
    # the count is the rate's, whatever the seed: a step labelled 1.5 req/s offers 1.5 req/s,
    # in its judged part too (here the last 10 of 15 s)
    assert {len(poisson_arrivals(1.5, 16, seed=s)) for s in range(20)} == {24} and len(a) == 1000
    assert {sum(t >= 5 for t in poisson_arrivals(1.5, 15, seed=s, judged_from=5)) for s in range(20)} == {15}
    # ...while the times stay a Poisson process's: the gaps' coefficient of variation is about 1
    gaps = np.diff(a)
    assert 0.85 < gaps.std() / gaps.mean() < 1.15


def test_modes_on_two_and_sixteen_cores():
    assert (mode("multiprocess", 2).knobs.process_count, mode("multiprocess", 2).knobs.io_threads) == (2, 0)
    assert (mode("multithread", 2).knobs.process_count, mode("multithread", 2).knobs.threads_per_process) == (1, 2)
    hybrid = mode("hybrid", 16).knobs
    assert (hybrid.process_count, hybrid.threads_per_process) == (8, 2) and not mode("hybrid", 16).allow_oversubscription
    assert mode("hybrid", 2).allow_oversubscription  # 2 × 2 on 2 cores, said so
    assert mode("autotuned", 2).autotune and mode("autotuned", 2).knobs == SEED_DEFAULTS
    custom = mode("static:process_count=1,max_batch_size=64", 2)
    assert (custom.knobs.process_count, custom.knobs.max_batch_size, custom.autotune) == (1, 64, False)
    assert mode("autotuned:process_count=1,threads_per_process=1,max_batch_size=1", 2).knobs.max_batch_size == 1
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        mode("turbo", 2)
    shipped = mode("default", 2)  # `selftune serve` with no options
    assert shipped.autotune and shipped.knobs == SHIPPED.replace(process_count=2) and shipped.dtype is None
    fp32 = mode("default@float32", 2)
    assert (fp32.name, fp32.knobs, fp32.autotune, fp32.dtype, fp32.backend) == ("default@float32", shipped.knobs, True, "float32", None)
    assert fp32.server_config("builtin:minilm")["model"] == {"name": "builtin:minilm", "task": "embed", "dtype": "float32"}
    ort = mode("static:process_count=1,max_batch_size=64@onnxruntime", 2)
    assert ort.knobs.max_batch_size == 64 and ort.server_config("m")["model"]["backend"] == "onnxruntime" and "dtype" not in ort.server_config("m")["model"]
    with pytest.raises(ValueError, match="after @ one of float32, bfloat16, torch, onnxruntime"):
        mode("multiprocess@int4", 2)
    with pytest.raises(ValueError, match="unknown knob 'speed'"):
        mode("static:speed=3", 2)
    grid = oracle_candidates(2, quick=False)
    assert all(k.process_count * k.threads_per_process <= 2 for k in grid)
    # the fixed modes' own configurations are candidates: the oracle cannot rank below them by construction
    assert mode("multiprocess", 2).knobs in grid and mode("multithread", 2).knobs in grid
    assert mode("multiprocess", 2).knobs in oracle_candidates(2, quick=True)


def test_mode_lists_and_grids_parse():
    from autotune.bench.cli import parse_words, split_modes
    from autotune.bench.modes import parse_grid

    assert parse_words("8-48") == (8, 48) and parse_words("32") == (32, 32)

    assert split_modes("autotuned,static:process_count=2,max_batch_size=64,hybrid") == ["autotuned", "static:process_count=2,max_batch_size=64", "hybrid"]
    grid = parse_grid("process_count=1,2;threads_per_process=1,2;max_batch_size=4,64", cores=2)
    assert sorted((k.process_count, k.threads_per_process, k.max_batch_size) for k in grid) == [(1, 1, 4), (1, 1, 64), (1, 2, 4), (1, 2, 64), (2, 1, 4), (2, 1, 64)]
    with pytest.raises(ValueError, match="--grid"):
        parse_grid("speed=1,2", cores=2)


def test_load_generator_offers_a_high_rate_to_an_endpoint_that_answers_at_once():
    check = generator_check(400, 2.0, b'{"input": "x"}')
    print(f"\ngenerator: {check}")
    assert check["ok_fraction"] == 1.0
    assert check["achieved"] >= 0.95 * 400
    assert check["lag_p99_ms"] < 100


def test_capacity_ladder_and_stage_headers_against_a_real_server(tmp_path):
    config = {"model": {"dtype": "float32"}, "concurrency": {"process_count": 1, "max_batch_size": 8}, "autotune": {"enabled": False}}
    server = ServerProcess(tmp_path, config)
    log = RunLog(server.url)
    try:
        plan = CapacityPlan(LadderConfig(start=10, factor=2, refine=0, max_steps=2), step_seconds=2.0, min_judged=10, settle=0.25, warmup_seconds=1.0, slo=0.5)
        best, steps = capacity(server.url, server.cpu_seconds, log, plan, ["a short sentence", "another one to embed"], "test", print)
        assert [s.offered for s in steps] == [10, 20]
        assert best == 20 and all(s.passed for s in steps)
        assert all(s.cpu_cores > 0 for s in steps)
        assert {"queue", "model", "server"} <= set(steps[0].stages) and steps[0].stages["model"] > 0
        assert len(log.requests) >= 50 and all(ok for _, _, ok in log.requests)
        assert log.rows and log.rows[-1]["process_count"] == 1  # knobs polled while it ran
        assert server.memory_bytes() > 50 * 2**20
    finally:
        log.close()
        server.stop()


def test_bodies_of_many_inputs_cover_the_texts_in_seeded_order():
    from autotune.bench.runner import embed_body

    texts = [f"text {i}" for i in range(64)]
    body = embed_body(texts, seed=3, inputs=16)
    requests = [json.loads(body(i))["input"] for i in range(4)]
    assert all(isinstance(r, list) and len(r) == 16 for r in requests)
    assert sorted(t for r in requests for t in r) == sorted(texts)  # four requests: every text once
    assert body(4) == body(0) and body(1) != embed_body(texts, seed=4, inputs=16)(1)
    assert isinstance(json.loads(embed_body(texts, seed=3)(0))["input"], str)  # one input: a plain string, as before


def test_the_ladder_sends_requests_of_many_inputs_to_a_real_server(tmp_path):
    import httpx

    config = {"model": {"dtype": "float32"}, "concurrency": {"process_count": 2, "threads_per_process": 1, "max_batch_size": 8}, "autotune": {"enabled": False}}
    server = ServerProcess(tmp_path, config)
    log = RunLog(server.url)
    try:
        plan = CapacityPlan(LadderConfig(start=2, factor=2, refine=0, max_steps=2), step_seconds=2.0, min_judged=2, settle=0.25, warmup_seconds=1.0,
                            slo=2.0, inputs_per_request=16)
        best, steps = capacity(server.url, server.cpu_seconds, log, plan, [f"a sentence number {i} to index" for i in range(64)], "test", print)
        counters = httpx.get(server.url + "/stats").json()["counters"]
    finally:
        log.close()
        server.stop()
    assert [s.offered for s in steps] == [2, 4] and best == 4, [s.as_dict() for s in steps]
    assert counters["items"] == 16 * counters["requests"] and counters["requests"] >= 10
    assert counters["batches"] >= 2 * counters["requests"]  # 16 inputs at batch 8: each request ran in two batches at least


def test_a_mode_runs_its_server_in_the_dtype_asked_and_reports_what_it_served(tmp_path):
    import dataclasses

    from autotune.bench.runner import run_mode

    m = dataclasses.replace(mode("static:process_count=1,max_batch_size=8", 2), dtype="float32")
    plan = CapacityPlan(LadderConfig(start=5, factor=2, refine=0, max_steps=1), step_seconds=1.5, min_judged=2, settle=0.25, warmup_seconds=0.5, slo=2.0)
    result, log = run_mode(m, "builtin:minilm", str(tmp_path), print, 2.0, plan=plan, texts=["a sentence to embed", "another one"])
    assert result.dtype == "float32" and result.max_qps == 5 and result.final_knobs["max_batch_size"] == 8


def test_tables_and_verdicts_of_many_inputs_per_request_compare_sentences_per_second():
    from autotune.bench.report import capacity_table

    limit = {"sentences_per_second": 400.0, "processes": 2, "threads": 1, "batch_size": 64, "dtype": "bfloat16", "table": {"2x1": {"1": 100.0, "64": 400.0}}}
    best = ModeResult("multiprocess", "2 × 1", {}, {}, max_qps=10.5, at_max={}, inputs_per_request=32)
    assert best.max_sentences_per_second == 336.0
    table = capacity_table([best], limit, 0.5, inputs=32).splitlines()
    assert "max QPS (p99 ≤ 500 ms): req/s (sentences/s, 32 per request)" in table[0]
    assert "| **10.5** (336) |" in table[2] and "| **12.5** (400) |" in table[-1]
    assert verdicts([best], limit)[0] == "best served mode multiprocess: 10.5 req/s × 32 = 336 sentences/s = 0.84 × limit (400/s, bfloat16: the backend the server serves)"


def test_open_loop_keeps_the_schedule_when_the_server_is_slow(tmp_path):
    """Open loop: a slow server does not slow the arrivals (latency grows, lag does not)."""
    config = {"model": {"dtype": "float32"}, "concurrency": {"process_count": 1, "max_batch_size": 1, "batch_timeout": 0.0}, "autotune": {"enabled": False}}
    server = ServerProcess(tmp_path, config)
    try:
        text = " ".join(["word"] * 200)
        body = json.dumps({"model": "all-MiniLM-L6-v2", "input": text}).encode()
        results = loadgen.run(server.url, [i / 100 for i in range(100)], body)  # 100/s, far over capacity
    finally:
        server.stop()
    assert all(r.status == 200 for r in results)
    assert max(r.lag for r in results) < 0.2
    assert results[-1].latency > 0.5  # queued behind the others


def test_bench_cli_rejects_unknown_modes_and_workloads():
    run = lambda *a: subprocess.run([sys.executable, "-m", "autotune.cli", "bench", *a], capture_output=True, text=True, timeout=60)  # noqa: E731
    for words, why in (("48-8", "needs 1 <= MIN <= MAX"), ("many", "is not MIN-MAX")):
        bad_words = run("--words", words)
        assert bad_words.returncode == 2 and f"--words: {words!r} {why}" in bad_words.stderr
    bad_mode = run("--modes", "multiprocess,turbo")
    assert bad_mode.returncode == 2 and "unknown mode 'turbo'" in bad_mode.stderr
    for extra, why in ((("--inputs-per-request", "0"), "needs a whole number >= 1"), (("--inputs-per-request", "8", "--workload", "poisson:rate=1,duration=1"), "only for the rate ladder")):
        bad_inputs = run(*extra)
        assert bad_inputs.returncode == 2 and "--inputs-per-request: " in bad_inputs.stderr and why in bad_inputs.stderr
    bad_workload = run("--workload", "zigzag:rate=3")
    assert bad_workload.returncode == 2 and "workload kind 'zigzag'" in bad_workload.stderr


def test_server_cpu_seconds_keep_what_an_exited_process_used():
    """A worker the controller retires takes its CPU seconds with it; the server's total must not drop (a step read -0.35 cores)."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nsys.stdin.read()"],
                             stdin=subprocess.PIPE)
    server = ServerProcess.__new__(ServerProcess)  # its bookkeeping only, over a process of our own
    server._cpu_seen = {}
    tracked = psutil.Process(child.pid)
    server.processes = lambda: [tracked] if child.poll() is None else []
    deadline = time.monotonic() + 30
    while server.cpu_seconds() < 0.3 and time.monotonic() < deadline:
        time.sleep(0.05)
    before = server.cpu_seconds()
    child.communicate(b"")
    assert before >= 0.3 and server.cpu_seconds() == before
