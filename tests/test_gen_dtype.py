"""`model.dtype: auto` for generation on a CPU: the decision (pure), the probe on the tiny causal
LM, and the engine's choice with native bf16 forced off and on."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from autotune.bench.server import ServerProcess
from engine.config import EngineConfig, Knobs
from engine.engine import Engine
from engine.gen_dtype import MIN_TOKEN_AGREEMENT, decide_generation_dtype, probe_generation_dtype
from engine.loading import MIN_SPEEDUP, NATIVE_BF16_ENV, token_ids
from engine.sampling import SamplingParams

GOOD = {"token_agreement": 1.0, "top1_agreement": 0.97, "mean_kl": 0.002, "speedup": 2.0, "float32_step_ms": [100.0], "bfloat16_step_ms": [50.0]}


def test_auto_takes_bf16_only_native_faithful_and_faster():
    assert decide_generation_dtype("auto", (True, "avx512_bf16"), GOOD)["dtype"] == "bfloat16"
    chosen = decide_generation_dtype("auto", (True, "avx512_bf16"), GOOD)
    assert chosen["mode"] == "cast" and chosen["bf16_token_agreement"] == 1.0 and chosen["bf16_speedup"] == 2.0 and "2.00x" in chosen["reason"]
    no_native = decide_generation_dtype("auto", (False, "no avx512_bf16 or amx_bf16 in /proc/cpuinfo"), None)
    assert no_native["dtype"] == "float32" and no_native["reason"].startswith("no native bf16") and no_native["min_cosine"] == 1.0
    unfaithful = decide_generation_dtype("auto", (True, "flags"), {**GOOD, "token_agreement": MIN_TOKEN_AGREEMENT - 0.01})
    assert unfaithful["dtype"] == "float32" and "near tie" in unfaithful["reason"]
    slow = decide_generation_dtype("auto", (True, "flags"), {**GOOD, "speedup": MIN_SPEEDUP - 0.05})
    assert slow["dtype"] == "float32" and "decode step only" in slow["reason"]
    failed = decide_generation_dtype("auto", (True, "flags"), None, "RuntimeError: no kernel")
    assert failed["dtype"] == "float32" and "probe failed" in failed["reason"] and failed["probe_error"] == "RuntimeError: no kernel"
    assert decide_generation_dtype("float32", (True, "flags"), GOOD)["dtype"] == "float32"  # forced wins over a good probe


def test_the_probe_compares_every_position_and_leaves_the_model_as_it_was(tiny_causal_lm):
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_causal_lm, dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = token_ids(AutoTokenizer.from_pretrained(tiny_causal_lm), ["hello world", "The quick brown fox jumps over the lazy dog."])
    probe = probe_generation_dtype(model, ids, rounds=2, steps=2)
    assert probe["positions"] == sum(len(x) for x in ids) and probe["probe_texts"] == 2
    assert 0.0 <= probe["top1_agreement"] <= probe["token_agreement"] <= 1.0 and probe["mean_kl"] >= 0.0
    assert len(probe["float32_step_ms"]) == len(probe["bfloat16_step_ms"]) == 2 and probe["speedup"] > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_cpu_without_native_bf16_stays_on_fp32(tiny_causal_lm, monkeypatch):
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")  # the zygote inherits it: a CPU without avx512_bf16/AMX
    config = EngineConfig(model=tiny_causal_lm, task="generate", knobs=Knobs(process_count=1, max_batch_size=2))
    with Engine(config) as eng:
        choice = eng.dtype_choice
        assert choice["requested"] == "auto" and eng.dtype == choice["dtype"] == "float32"
        assert choice["reason"] == f"no native bf16 ({NATIVE_BF16_ENV}=0)" and "bf16_speedup" not in choice
        tokens = [e.token_id for e in eng.generate([101, 7592, 2088], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
        assert len(tokens) == 5


def test_the_server_serves_what_the_probe_chose_and_shows_it(tiny_causal_lm, monkeypatch, tmp_path):
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")  # the server's zygote inherits it: a CPU with native bf16
    config = {"model": {"name": tiny_causal_lm, "task": "generate"}, "concurrency": {"process_count": 1}, "autotune": {"enabled": False}}
    srv = ServerProcess(tmp_path, config)
    try:
        model = httpx.get(srv.url + "/stats").json()["model"]
        choice = model["dtype_choice"]
        assert choice["requested"] == "auto" and model["dtype"] == choice["dtype"]
        # probed: the decision follows what the probe measured on this machine
        assert 0 < choice["bf16_token_agreement"] <= 1 and choice["bf16_speedup"] > 0
        faithful_and_fast = choice["bf16_token_agreement"] >= MIN_TOKEN_AGREEMENT and choice["bf16_speedup"] >= MIN_SPEEDUP
        assert choice["dtype"] == ("bfloat16" if faithful_and_fast else "float32")
        metrics = httpx.get(srv.url + "/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("selftune_model_bf16_token_agreement_ratio "))
        assert float(line.split()[-1]) == pytest.approx(choice["bf16_token_agreement"]) and f'dtype="{choice["dtype"]}"' in metrics
        done = httpx.post(srv.url + "/v1/completions", json={"model": httpx.get(srv.url + "/v1/models").json()["data"][0]["id"], "prompt": "hello", "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 5
        assert f"dtype {choice['dtype']}" in srv.log() and "near tie" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
