"""`max_batch_tokens: auto` for generation on a CPU: the decision (pure, on step times recorded on
two machines), the probe on the tiny causal LM, what the config asks the engine to measure, and a
server that starts at the measured chunk and shows why."""

from __future__ import annotations

import httpx
import torch
from transformers import AutoModelForCausalLM

from autotune.bench.server import ServerProcess
from autotune.settings import load_config
from engine.gen_chunk import CHUNK_RANGE, CHUNK_STEP, STEP_BUDGET_MS, decide_batch_tokens, probe_batch_tokens, time_chunk_steps

# step times of SmolLM2-135M on one thread, 4 rows decoding, a 128-token chunk beside them (engine.gen_chunk's probe)
XEON_BF16 = {"rows": 4, "chunk": 128, "decode_ms": 56.0, "chunk_step_ms": 125.0}  # AMX: ~0.54 ms a prompt token
XEON_FP32 = {"rows": 4, "chunk": 128, "decode_ms": 90.0, "chunk_step_ms": 282.0}  # ~1.5 ms a prompt token


def test_auto_chunk_is_the_largest_multiple_of_the_step_whose_step_fits_the_budget():
    bf16 = decide_batch_tokens(XEON_BF16, fallback=32)
    # 160 tokens: 56 + 160 × 0.54 = 142 ms; 176 would be 151 ms, over the 150-ms budget
    assert bf16["per_thread"] == 160 and bf16["ms_per_prompt_token"] == round(69 / 128, 4)
    assert "160 tokens a step" in bf16["reason"] and bf16["budget_ms"] == STEP_BUDGET_MS
    assert decide_batch_tokens(XEON_FP32, fallback=32)["per_thread"] == 32  # 90 + 48 = 138 ms; 48 would be 162
    assert all(decide_batch_tokens({**XEON_BF16, "chunk_step_ms": ms}, 32)["per_thread"] % CHUNK_STEP == 0 for ms in range(57, 400, 7))
    # a step that barely costs more per token is capped; one whose decode alone is over the budget gets the least
    assert decide_batch_tokens({**XEON_BF16, "chunk_step_ms": 57.0}, fallback=32)["per_thread"] == CHUNK_RANGE[1]
    assert decide_batch_tokens({**XEON_BF16, "decode_ms": 400.0, "chunk_step_ms": 900.0}, fallback=32)["per_thread"] == CHUNK_RANGE[0]
    # a chunk step measured faster than the decode step (noise) is no prompt cost, not a negative one
    assert decide_batch_tokens({**XEON_BF16, "chunk_step_ms": 50.0}, fallback=32)["ms_per_prompt_token"] == 0.0


def test_a_probe_a_few_per_cent_slower_moves_auto_chunk_a_little_not_by_half():
    # a 128-token chunk step at 148 ms and at 156 ms (5 % apart, this VM's drift within a minute)
    near = [decide_batch_tokens({**XEON_BF16, "chunk_step_ms": ms}, 32)["per_thread"] for ms in (148.0, 156.0)]
    assert near == [128, 112]  # powers of two picked 128 and 64


def test_without_a_probe_auto_keeps_the_constant_and_says_why():
    failed = decide_batch_tokens(None, fallback=32, error="the probe took over 120s")
    assert failed["per_thread"] == 32 and failed["probe_error"] == "the probe took over 120s" and "not measured" in failed["reason"]


def test_the_probe_times_decode_and_whole_chunk_steps_on_a_short_context(tiny_causal_lm):
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32).eval()
    # the tiny model's context is 256 positions: the 256-token prompt shrinks to 128, in 2 chunks of 64
    steps = time_chunk_steps(model)
    assert (steps["prompt"], steps["chunk"]) == (128, 64) and len(steps["prefill_steps_ms"]) == 2
    probe = probe_batch_tokens(model, rounds=1)
    assert probe["chunk"] == 64 and probe["decode_ms"] > 0 and probe["chunk_step_ms"] > 0 and probe["rows"] == 4


def test_the_config_asks_for_a_measured_chunk_only_when_it_says_auto_on_a_cpu(tmp_path):
    def measured(**sections) -> bool:
        path = tmp_path / "c.yaml"
        path.write_text("".join(f"{name}:\n" + "".join(f"  {k}: {v}\n" for k, v in keys.items()) for name, keys in sections.items()) or "{}\n")
        return load_config(path).engine_config().measure_batch_tokens

    assert measured(model={"task": "generate"})
    assert not measured(model={"task": "generate"}, concurrency={"max_batch_tokens": 64})
    assert not measured(model={"task": "generate", "device": "cuda"})


def test_the_server_starts_at_the_measured_chunk_and_shows_it(tiny_causal_lm, tmp_path):
    config = {"model": {"name": tiny_causal_lm, "task": "generate", "dtype": "float32"},
              "concurrency": {"process_count": 1, "threads_per_process": 1}, "autotune": {"enabled": False}}
    srv = ServerProcess(tmp_path, config)
    try:
        stats = httpx.get(srv.url + "/stats").json()
        choice = stats["model"]["batch_tokens_choice"]
        assert CHUNK_RANGE[0] <= choice["per_thread"] <= CHUNK_RANGE[1] and choice["decode_ms"] > 0
        assert stats["knobs"]["max_batch_tokens"] == choice["per_thread"]  # one thread per worker
        assert choice["per_thread"] == decide_batch_tokens({"rows": 4, "chunk": choice["probe_chunk"], "decode_ms": choice["decode_ms"],
                                                            "chunk_step_ms": choice["chunk_step_ms"]}, fallback=0)["per_thread"]
        assert f"max_batch_tokens auto: {choice['per_thread']} prompt tokens a step" in srv.log()
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        done = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "hello " * 40, "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
    finally:
        assert srv.stop() == 0, srv.log()


def test_the_simulator_starts_auto_where_the_live_probe_would_on_the_profiled_machine():
    from autotune import shipped
    from autotune.offline.gen_cli import sim_knobs
    from autotune.offline.gen_costmodel import auto_batch_tokens, load_gen_cost_model

    cost = load_gen_cost_model(str(shipped.resolve("builtin:epyc-2core-smollm2-generate", shipped.COST_MODEL)))
    choice = auto_batch_tokens(cost)  # the same decision, on the cost model's steps instead of timed ones
    assert choice == decide_batch_tokens({"rows": 4, "chunk": 128, "decode_ms": choice["decode_ms"], "chunk_step_ms": choice["chunk_step_ms"]}, 32)
    assert choice["decode_ms"] == 1000 * cost.step_seconds(0, 4, 72, 1) and choice["chunk_step_ms"] > choice["decode_ms"]
    per_thread = choice["per_thread"]
    assert sim_knobs("process_count=2,max_batch_tokens=auto", cost).max_batch_tokens == per_thread
    assert sim_knobs("process_count=1,threads_per_process=2,max_batch_tokens=auto", cost).max_batch_tokens == 2 * per_thread
    assert sim_knobs("process_count=2,max_batch_tokens=64", cost).max_batch_tokens == 64
