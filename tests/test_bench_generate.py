"""`selftune bench --task generate`: the judge (pure), the requests, the streaming load generator
against a real server on the tiny causal LM, the in-process limit, and the command end to end."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from autotune.bench import gen_inputs, stream_loadgen
from autotune.bench.gen_capacity import judge_generation
from autotune.bench.gen_report import generation_table, generation_verdicts
from autotune.bench.gen_runner import GEN_REQUEST_COLUMNS, write_gen_results
from autotune.bench.modes import SHIPPED, generation_candidates, mode
from autotune.bench.runner import ModeResult, new_request_log
from autotune.bench.server import ServerProcess
from autotune.bench.stream_loadgen import StreamResult
from autotune.controller import without_holds


def stream(sent_at: float, ttft: float = 0.1, gap: float = 0.05, tokens: int = 8, status: int = 200, **kw) -> StreamResult:
    """A finished stream: first token at `ttft`, then one every `gap` seconds."""
    times = tuple(ttft + gap * k for k in range(tokens)) if status == 200 else ()
    latency = times[-1] if times else math.nan
    return StreamResult(sent_at, status, times, latency, output_tokens=len(times), **kw)


def test_judge_passes_only_with_both_p99s_within_and_nothing_failed():
    fine = [stream(t / 10) for t in range(100)]
    step = judge_generation(fine, 10, 0.0, 10, ttft_slo=2.0, itl_slo=0.25)
    assert step.passed and step.failed == 0 and step.judged == 100 and step.completed == 100
    assert step.ttft_p99 == pytest.approx(0.1) and step.itl_p99 == pytest.approx(0.05)
    assert step.e2e_p99 == pytest.approx(0.1 + 7 * 0.05) and step.goodput == pytest.approx(10.0)
    refused = fine[:99] + [stream(9.9, status=429)]  # one 429 of 100: the step fails
    assert not judge_generation(refused, 10, 0.0, 10, 2.0, 0.25).passed
    assert judge_generation(refused, 10, 0.0, 10, 2.0, 0.25).statuses == {"200": 99, "429": 1}
    slow_first = [stream(t / 10, ttft=2.5 if t % 10 == 0 else 0.1) for t in range(100)]
    assert not judge_generation(slow_first, 10, 0.0, 10, 2.0, 0.25).passed  # 10 % over the TTFT objective
    stalls = [stream(t / 10, gap=0.3 if t % 2 else 0.05) for t in range(100)]
    step = judge_generation(stalls, 10, 0.0, 10, 2.0, 0.25)
    assert not step.passed and step.itl_p99 == pytest.approx(0.3) and step.goodput == pytest.approx(5.0)
    error_event = fine[:99] + [StreamResult(9.9, 200, (0.1,), error="the request did not finish")]
    assert judge_generation(error_event, 10, 0.0, 10, 2.0, 0.25).failed == 1


def test_judge_skips_the_settling_part_and_counts_tokens_in_the_window():
    results = [stream(t / 10, ttft=3.0 if t < 30 else 0.1) for t in range(100)]
    assert not judge_generation(results, 10, 0.0, 10, 2.0, 0.25).passed
    step = judge_generation(results, 10, 3.0, 10, 2.0, 0.25)
    assert step.passed and step.judged == 70
    # tokens that arrived in [3, 10] s, the settling part's requests' included, per second
    arrived = sum(1 for r in results for t in r.token_times if 3.0 <= r.sent_at + t <= 10)
    assert step.output_tokens_per_s == pytest.approx(arrived / 7)


def test_judge_takes_cut_streams_for_what_they_showed():
    waiting = StreamResult(9.0, 0, (), cut_at=3.0)  # no answer yet when cut: TTFT at least 3 s
    stalled = StreamResult(9.0, 200, (0.1, 0.15), cut_at=1.0)  # its open gap (0.85 s) passed the ITL objective
    short = StreamResult(9.5, 200, (0.1, 0.15), cut_at=0.2)  # its open gap (0.05 s) tells nothing yet
    fine = [stream(t / 10) for t in range(90)]
    assert waiting.ok and waiting.ttft == 3.0 and not waiting.completed
    step = judge_generation(fine + [waiting] * 2, 10, 0.0, 10, 2.0, 0.25)  # 2 of 92: past the p99
    assert step.cut == 2 and step.failed == 0 and step.ttft_p99 == pytest.approx(3.0) and not step.passed
    assert judge_generation(fine + [short], 10, 0.0, 10, 2.0, 0.25).passed
    gaps = judge_generation(fine + [stalled] * 10, 10, 0.0, 10, 2.0, 0.25)  # 10 of 650 gaps
    assert not gaps.passed and gaps.itl_p99 > 0.25


def test_the_request_log_leaves_the_prompt_cell_empty_where_the_server_reported_no_usage(tmp_path):
    served, refused = stream(0.1, prompt_tokens=37), StreamResult(0.2, 429)
    f, writer = new_request_log(str(tmp_path / "requests.csv"), GEN_REQUEST_COLUMNS)
    with f:
        write_gen_results(writer, "multiprocess", 2.0, [served, refused])
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["prompt_tokens"] for r in rows] == ["37", ""] and [r["status"] for r in rows] == ["200", "429"]


def test_lengths_come_from_the_trace_clipped_and_prompts_tokenize_to_them(tiny_causal_lm):
    from engine.loading import load_tokenizer

    table = gen_inputs.read_lengths(gen_inputs.DEFAULT_TRACE)
    pairs = gen_inputs.draw_lengths(table, 64, seed=3, max_prompt=120, max_output=16, min_prompt=3)
    assert pairs == gen_inputs.draw_lengths(table, 64, seed=3, max_prompt=120, max_output=16, min_prompt=3)
    assert pairs != gen_inputs.draw_lengths(table, 64, seed=4, max_prompt=120, max_output=16, min_prompt=3)
    assert all(3 <= p <= 120 and 1 <= o <= 16 for p, o in pairs) and max(p for p, _ in pairs) == 120
    builder = gen_inputs.PromptBuilder(load_tokenizer(tiny_causal_lm))
    assert builder.specials == 2  # the tiny model borrows MiniLM's tokenizer: [CLS] ... [SEP]
    assert all(builder.count(builder.text(p, seed=i)) == p for i, (p, _) in enumerate(pairs))
    body = json.loads(gen_inputs.bodies(builder, pairs[:1], "m", "completions", seed=0)[0])
    assert body["max_tokens"] == pairs[0][1] and body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert "messages" in json.loads(gen_inputs.bodies(builder, pairs[:1], "m", "chat", seed=0)[0])


def test_generation_modes_ask_the_server_to_generate():
    config = mode("multiprocess", 2).server_config("builtin:smollm2", task="generate")
    assert config["model"] == {"name": "builtin:smollm2", "task": "generate"}
    assert mode("multiprocess", 2).server_config("builtin:minilm")["model"]["task"] == "embed"
    # the shipped modes' servers measure their chunk as `selftune serve` does; a chunk named stays as named
    assert config["concurrency"]["max_batch_tokens"] == "auto" and mode("default", 2).server_config("m")["concurrency"]["max_batch_tokens"] == "auto"
    assert mode("static:process_count=1", 2).server_config("m")["concurrency"]["max_batch_tokens"] == "auto"
    assert mode("static:max_batch_tokens=256", 2).server_config("m")["concurrency"]["max_batch_tokens"] == 256
    assert mode("autotuned", 2).server_config("m")["concurrency"]["max_batch_tokens"] == 32  # seed A is a config a user wrote


def test_the_generation_oracle_tries_both_layouts_batches_and_a_small_prefill_chunk():
    grid = generation_candidates(2, quick=True)
    assert {(k.process_count, k.threads_per_process) for k in grid} == {(2, 1), (1, 2)}
    assert {k.max_batch_tokens for k in grid} == {32, 256}  # the chunk is what keeps ITL, or TTFT
    assert len(grid) == 2 * 2 * 2 and all(k.process_count * k.threads_per_process == 2 for k in grid)


def test_streaming_load_generator_against_a_real_generating_server(tmp_path, tiny_causal_lm):
    from engine.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_causal_lm)
    builder = gen_inputs.PromptBuilder(tokenizer)
    word = tokenizer.convert_tokens_to_ids("city")  # biased to always win: every token is a chunk of text
    prompt = builder.text(20, seed=1)
    body = json.dumps({"model": tiny_causal_lm, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "logit_bias": {str(word): 100}}).encode()
    config = {"model": {"name": tiny_causal_lm, "task": "generate"}, "concurrency": {"process_count": 1, "max_batch_size": 4},
              "autotune": {"enabled": False}}
    server = ServerProcess(tmp_path, config)
    try:
        burst = stream_loadgen.run(server.url, [0.0] * 12 + [0.5 + k / 20 for k in range(10)], body)  # 12 at once, then 20/s
        cut = stream_loadgen.run(server.url, [0.0] * 6, json.dumps({**json.loads(body), "max_tokens": 200}).encode(), cut_after=0.3)
        refused = stream_loadgen.run(server.url, [0.0], json.dumps({**json.loads(body), "model": "gpt-nothing"}).encode())
    finally:
        server.stop()
    assert all(r.completed and r.status == 200 and not r.error for r in burst)
    for r in burst:
        assert r.output_tokens == 12 and len(r.token_times) == 12 and len(r.itls()) == 11  # ITLs: tokens − 1
        assert r.prompt_tokens == 20  # the builder's prompt, as the server counted it
        assert 0 < r.ttft <= r.latency and r.token_times[-1] <= r.latency and np.all(r.itls() >= 0)
        assert r.lag < 0.2
    # from the scheduled time: 12 sent together, 4 running at a time, so the last ones waited for the first ones
    assert max(r.ttft for r in burst[:12]) > min(r.latency for r in burst[:12])
    assert all(r.ok and not r.completed and r.cut_at >= 0.29 for r in cut) and math.isnan(cut[0].latency)
    assert refused[0].status == 404 and not refused[0].ok


def test_generation_limit_on_the_tiny_model(tiny_causal_lm):
    from autotune.bench.gen_limit import measure_generation_limit

    lines = []
    pairs = [(12, 3), (30, 9), (5, 1), (20, 6)]
    limit = measure_generation_limit(tiny_causal_lm, cores=2, prompt_tokens=16, batch_sizes=(1, 4), duration=0.2, say=lines.append,
                                     pairs=pairs, mix_duration=0.3)
    # both layouts that fill the cores; 2 × 1 splits the sequences, so its smallest batch is 2 × 1
    assert set(limit["table"]["1x2"]) == {1, 4} and set(limit["table"]["2x1"]) == {2, 4} and limit["prompt_tokens"] == 16
    cells = [v for row in limit["table"].values() for v in row.values()]
    assert all(v > 0 for v in cells) and limit["tokens_per_second"] == max(cells)
    assert limit["table"][f"{limit['processes']}x{limit['threads']}"][limit["batch_size"]] == limit["tokens_per_second"]
    assert all(v > 0 for row in limit["prefill_tokens_per_second"].values() for v in row.values())
    assert lines[0].startswith("limit 1x2, prompts of 16 tokens: B=1:") and lines[2].startswith("limit 2x1")
    # serving the requests themselves (closed loop, prefill included), per layout at the same batch sizes
    assert set(limit["with_prefill"]["1x2"]) == {1, 4} and set(limit["with_prefill"]["2x1"]) == {2, 4}
    assert all(v > 0 for row in limit["with_prefill"].values() for v in row.values())
    assert lines[1].startswith("limit 1x2, serving the requests (prefill included): B=1:")


def test_table_and_verdicts_set_the_best_mode_against_the_limit_at_its_batch():
    limit = {"tokens_per_second": 200.0, "batch_size": 32, "processes": 1, "threads": 2, "prompt_tokens": 64, "dtype": "bfloat16",
             "table": {"1x2": {1: 20.0, 8: 80.0, 32: 200.0}, "2x1": {2: 30.0, 8: 60.0, 32: 150.0}},
             "with_prefill": {"1x2": {"1": 10.0, "8": 40.0, "32": 90.0}, "2x1": {"2": 12.0, "8": 50.0, "32": 70.0}}}  # keys as JSON gives them back
    at = {"output_tokens_per_s": 60.0, "running": 8.0, "goodput": 1.0, "ttft_p50": 0.2, "ttft_p99": 1.5, "itl_p50": 0.1, "itl_p99": 0.2,
          "e2e_mean": 3.0, "e2e_p99": 5.0, "cpu_cores": 1.9}
    tuned = ModeResult("autotuned", "", {}, {}, max_qps=1.0, at_max=at)
    fixed = ModeResult("multiprocess", "", {}, {}, max_qps=0.8, at_max={**at, "output_tokens_per_s": 50.0})
    lines = generation_verdicts([fixed, tuned], limit)
    assert lines[0].startswith("best served mode autotuned: 60.0 output tokens/s at 1.00 req/s = 0.30 × the limit")
    assert "the in-process decode limit is 80.0 tok/s: 0.75 × that" in lines[1]
    assert lines[2].endswith("(prefill included), the limit is 50.0 tok/s: 1.20 × that")  # the better layout at B=8
    assert lines[-1] == "autotuned ahead of: multiprocess"
    table = generation_table([fixed, tuned], limit, 2.0, 0.25)
    assert "| autotuned |  | **1.00** | 60.0 | 1.00 | 200 / 1500 | 100 / 200 |" in table
    assert "| limit | in-process decode, no server: 1 × 2, bfloat16, prompts of 64 tokens (B=1: 20, B=8: 80, B=32: 200 tok/s) |" in table
    assert "(1 × 2: B=1: 10, B=8: 40, B=32: 90; 2 × 1: B=2: 12, B=8: 50, B=32: 70 tok/s) | | **90.0** (1 × 2, B=32) |" in table


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "autotune.cli", "bench", "--task", "generate", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_generate_rejects_bad_flags():
    for flags, why in ((("--ttft-slo", "0"),), "--ttft-slo: 0.0 must be a positive number"), \
                      ((("--max-output-tokens", "-3"),), "--max-output-tokens: -3 must be a positive number"), \
                      ((("--workload", "wobble:rate=1,duration=5"),), "workload kind 'wobble'"), \
                      ((("--workload", "poisson:rate=1,duration=0"),), "makes no arrivals"), \
                      ((("--trace", "nowhere.csv"),), "--trace: 'nowhere.csv' not found"), \
                      ((("--modes", "multiprocess,turbo"),), "unknown mode 'turbo'"):
        done = run_bench(*flags[0], timeout=60)
        assert done.returncode == 2 and why in done.stderr, done.stderr


def test_bench_generate_quick_end_to_end(tmp_path, tiny_causal_lm):
    out = tmp_path / "out"
    done = run_bench("--quick", "--modes", "multiprocess", "--no-generator-check", "--model", tiny_causal_lm, "--json",
                     "--step-seconds", "1.5", "--max-output-tokens", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    (m,) = summary["modes"]
    assert m["mode"] == "multiprocess" and m["max_qps"] > 0 and m["steps"] and summary["task"] == "generate"
    assert m["at_max"]["passed"] and m["at_max"]["ttft_p99"] <= 2.0 and m["at_max"]["itl_p99"] <= 0.25 and m["at_max"]["output_tokens_per_s"] > 0
    assert summary["limit"]["tokens_per_second"] > 0 and summary["requests"]["max_output_tokens"] == 12
    # the recorded least prompt (a replay draws lengths by it) is one the server counted no more than;
    # a refused or cut request reports no usage, and its cell is empty
    with open(out / "requests.csv") as f:
        counted = [int(r["prompt_tokens"]) for r in csv.DictReader(f) if r["prompt_tokens"]]
    assert counted and 1 <= summary["requests"]["min_prompt_tokens"] <= min(counted)
    assert {"bench.md", "bench.json", "generation-curves.png", "requests.csv"} <= {p.name for p in out.iterdir()}
    assert "| multiprocess |" in done.stdout and "| limit |" in done.stdout and "| limit, these requests |" in done.stdout
    assert set(summary["limit"]["with_prefill"]) == {"1x2", "2x1"}  # its cells 1 s each: two thirds of a 1.5-s rung


def test_bench_generate_replays_a_workload_against_each_mode_and_the_grid(tmp_path, tiny_causal_lm):
    from autotune.bench.workloads import from_spec

    spec = "onoff:on_rate=3,off_rate=0.5,on_seconds=2,off_seconds=2,duration=6"
    out = tmp_path / "out"
    done = run_bench("--quick", "--modes", "autotuned,multiprocess,oracle", "--grid", "process_count=1;max_batch_size=4", "--workload", spec,
                     "--no-generator-check", "--model", tiny_causal_lm, "--json", "--max-output-tokens", "12", "--out", str(out), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    names = [m["mode"] for m in summary["modes"]]
    # the oracle is the grid's one static, replaying the same arrivals as the others
    assert names == ["autotuned", "multiprocess", "static:process_count=1,threads_per_process=1,io_threads=2,max_batch_size=4,max_batch_tokens=32"]
    assert summary["workload"] == spec and summary["limit"] is None and summary["generator_check"] is None
    arrivals = len(from_spec(spec))
    for m in summary["modes"]:
        w = m["workload"]
        assert w["judged"] == arrivals and w["failed"] == 0 and 0 < w["goodput"] <= w["offered"] and w["output_tokens_per_s"] > 0
        assert m["max_qps"] == 0 and not m["steps"]  # no ladder ran
    assert summary["modes"][1]["final_knobs"]["process_count"] == 2 and summary["modes"][2]["final_knobs"]["max_batch_size"] == 4
    # the policy's own reasons, fetched from the server before it stopped: first of all, 4 × 2 does not fit 2 cores
    first = without_holds(summary["modes"][0]["decisions"])[0]
    assert first["old"]["process_count"] == 4 and first["new"]["process_count"] < 4 and first["reason"] and isinstance(first["at"], float)
    assert summary["modes"][1]["decisions"] == []  # no policy runs there
    verdicts = summary["verdicts"]
    assert verdicts[0].startswith("best static (1 runs): static:process_count=1") and "of the best static; multiprocess" in verdicts[1]
    files = {p.name for p in out.iterdir()}
    assert {"bench.md", "bench.json", "requests.csv", "timeline-autotuned.png", "timeline-multiprocess.png"} <= files
    assert "generation-curves.png" not in files and "| multiprocess |" in done.stdout and f"workload {spec}" in (out / "bench.md").read_text()
    rows = (out / "requests.csv").read_text().splitlines()
    assert len(rows) - 1 >= 3 * arrivals  # every mode's replay (and its warm-up) logged


def test_a_generation_timeline_draws_the_prefill_chunk_knob(tmp_path, monkeypatch):
    import matplotlib.axes

    from autotune.plots import timeline

    drawn, step = {}, matplotlib.axes.Axes.step

    def recording_step(self, x, y, *args, **kwargs):
        drawn[kwargs.get("label")] = list(y)
        return step(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "step", recording_step)
    arrival = np.arange(10.0)
    changes = [(0.0, SHIPPED), (4.0, SHIPPED.replace(max_batch_tokens=64)), (6.0, SHIPPED.replace(max_batch_tokens=32))]
    timeline(arrival, arrival + 1.0, np.ones(10, bool), changes, 2.0, str(tmp_path / "t.png"), task="generate")
    assert drawn["max_batch_tokens"] == [SHIPPED.max_batch_tokens, 64, 32, 32] and "batch_timeout (ms)" not in drawn
    assert (tmp_path / "t.png").stat().st_size > 1000
