"""model.dtype for embeddings: bf16 (mixed: Linear weights bf16 under autocast, the rest fp32)
against fp32, the native-bf16 check, and `auto`'s start-up choice as /stats and /metrics show it."""

from __future__ import annotations

import copy
import time

import httpx
import numpy as np
import pytest
import torch
from conftest import minilm_dir

from autotune.bench.inputs import sentences
from autotune.bench.server import ServerProcess
from engine import zygote
from engine.config import EngineConfig, Knobs
from engine.embedding import PROBE_TEXTS, EmbeddingRunner, decide_dtype, probe_dtype
from engine.engine import Engine
from engine.loading import (
    MIN_COSINE,
    NATIVE_BF16_ENV,
    compute_dtype,
    cpu_flags,
    load_model,
    load_tokenizer,
    native_bf16,
    token_ids,
)

SHORT = ["ok", "yes", "no", "a", "hi", "?", "42", "thanks!", "hello", "the end"]
TEXTS = list(PROBE_TEXTS) + sentences(48, seed=21) + sentences(24, 1, 3, seed=22) + SHORT


# ---- the native-bf16 check and the decision (pure) ------------------------------------------


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx512f", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()


def test_native_bf16_follows_the_cpu_flags_unless_the_env_forces_it(monkeypatch):
    monkeypatch.delenv(NATIVE_BF16_ENV, raising=False)
    native, why = native_bf16("cpu")
    assert native == bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and why
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    assert native_bf16("cpu") == (False, f"{NATIVE_BF16_ENV}=0")
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert native_bf16("cpu") == (True, f"{NATIVE_BF16_ENV}=1")
    monkeypatch.setattr("engine.loading.cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2", "fma"}))
    monkeypatch.delenv(NATIVE_BF16_ENV)
    assert native_bf16("cpu")[0] is False


def test_auto_takes_bf16_only_when_native_faithful_and_faster():
    good = {"min_cosine": 0.99995, "speedup": 1.7, "probe_inputs": 16, "seconds": 1.0}
    assert decide_dtype("auto", (True, "flags"), good)["dtype"] == "bfloat16"
    assert decide_dtype("auto", (True, "flags"), good)["min_cosine"] == 0.99995
    no_native = decide_dtype("auto", (False, "no avx512_bf16"), None)
    assert no_native["dtype"] == "float32" and no_native["min_cosine"] == 1.0 and "no native bf16" in no_native["reason"]
    unfaithful = decide_dtype("auto", (True, "flags"), {**good, "min_cosine": 0.9998})
    assert unfaithful["dtype"] == "float32" and unfaithful["bf16_min_cosine"] == 0.9998 and unfaithful["min_cosine"] == 1.0
    assert decide_dtype("auto", (True, "flags"), {**good, "speedup": 1.02})["dtype"] == "float32"
    assert decide_dtype("auto", (True, "flags"), None, error="boom")["dtype"] == "float32"
    forced = decide_dtype("bfloat16", (False, "no avx512_bf16"), {**good, "min_cosine": 0.9998})
    assert forced["dtype"] == "bfloat16" and "forced" in forced["reason"]  # a user can force it


def test_the_choice_travels_to_the_front_in_the_zygote_message():
    import pickle

    from engine import messages as m

    msg = pickle.loads(pickle.dumps(m.ZygoteLoaded("cpu", "bfloat16", {"dtype": "bfloat16", "min_cosine": 0.99993})))
    assert msg.dtype == "bfloat16" and msg.dtype_choice["min_cosine"] == 0.99993


def test_a_failing_or_hanging_probe_leaves_auto_on_fp32(monkeypatch):
    def boom():
        raise RuntimeError("no bf16 kernel")

    answer = zygote._in_probe_child(boom)
    assert answer == {"error": "RuntimeError: no bf16 kernel"}
    assert decide_dtype("auto", (True, "flags"), answer.get("probe"), answer["error"])["dtype"] == "float32"

    monkeypatch.setattr(zygote, "PROBE_TIMEOUT", 0.5)
    started = time.monotonic()
    assert "took over" in zygote._in_probe_child(lambda: time.sleep(30))["error"]
    assert time.monotonic() - started < 5


# ---- fidelity, in-process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    path = minilm_dir()
    fp32 = load_model(path, "embed", torch.float32)
    return path, fp32, load_model(path, "embed", torch.bfloat16)


def _embed(model, ids, pack_row_tokens, batch):
    runner = EmbeddingRunner(model, "cpu", pack_row_tokens, 30522)
    out = np.empty((len(ids), 384), dtype=np.float32)
    for start in range(0, len(ids), batch):
        chunk = ids[start : start + batch]
        lengths = tuple(len(x) for x in chunk)
        matrix = np.zeros((len(chunk), max(lengths)), dtype=np.int32)
        for row, x in enumerate(chunk):
            matrix[row, : len(x)] = x
        runner.run(matrix, lengths, out[start : start + len(chunk)])
    return out


def test_bf16_loads_mixed_and_keeps_cosine_to_the_fp32_runner(models):
    path, fp32, bf16 = models
    assert compute_dtype(bf16) == torch.bfloat16 and bf16.embeddings.word_embeddings.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for name, p in bf16.named_parameters() if "LayerNorm" in name)
    ids = token_ids(load_tokenizer(path), TEXTS)
    want = _embed(fp32, ids, 0, 1)  # each text alone, fp32: what sentence-transformers computes
    for pack_row_tokens, batch in ((128, 16), (0, 16), (128, 64), (0, 1)):
        got = _embed(bf16, ids, pack_row_tokens, batch)
        cosine = (got * want).sum(axis=1)
        worst = int(np.argmin(cosine))
        assert cosine.min() >= MIN_COSINE, f"packed={pack_row_tokens} batch={batch}: {TEXTS[worst]!r} at {cosine.min():.6f}"
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_bf16_cast_whole_falls_short_where_mixed_holds(models):
    """Why bf16 is mixed, not cast: the whole-model cast loses the bar on very short inputs."""
    path, fp32, bf16 = models
    ids = token_ids(load_tokenizer(path), SHORT)
    want = _embed(fp32, ids, 0, 1)
    mixed = (_embed(bf16, ids, 128, 16) * want).sum(axis=1)
    cast = (_embed(copy.deepcopy(fp32).to(torch.bfloat16), ids, 128, 16) * want).sum(axis=1)
    print(f"\nshort inputs, worst cosine to fp32: mixed {mixed.min():.6f}, cast {cast.min():.6f}")
    assert mixed.min() >= MIN_COSINE and cast.min() < mixed.min()


def test_probe_measures_fidelity_and_speed_and_leaves_the_model_alone(models):
    path, fp32, _ = models
    before = {name: p.clone() for name, p in fp32.named_parameters()}
    ids = token_ids(load_tokenizer(path), list(PROBE_TEXTS))
    result = probe_dtype(fp32, "cpu", torch.bfloat16, ids, rounds=2, vocab_size=30522)
    assert result["probe_inputs"] == len(PROBE_TEXTS)
    assert result["min_cosine"] >= MIN_COSINE and len(result["float32_ms"]) == len(result["candidate_ms"]) == 2
    assert result["speedup"] > 0
    assert all(torch.equal(before[name], p) for name, p in fp32.named_parameters())
    assert compute_dtype(fp32) == torch.float32


# ---- live: the engine and the server ---------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir(), device="cpu")
    return model.encode(TEXTS[:40], batch_size=64)


def test_without_native_bf16_auto_stays_fp32(monkeypatch, reference):
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")  # the zygote inherits it: a CPU without avx512_bf16/AMX
    with Engine(EngineConfig(dtype="auto", knobs=Knobs(process_count=1, max_batch_size=8))) as eng:
        choice = eng.dtype_choice
        assert eng.dtype == "float32" and choice["dtype"] == "float32" and choice["native_bf16"] is False
        assert "no native bf16" in choice["reason"] and choice["min_cosine"] >= MIN_COSINE
        assert "bf16_speedup" not in choice  # bf16 was not probed (fp32 may be torch's or ONNX Runtime's: both fp32)
        vectors = eng.embed(TEXTS[:40]).result(timeout=60).vectors
    assert np.abs(vectors - reference).max() < 1e-4  # an exact fp32 path


def test_forced_bf16_is_kept_and_its_fidelity_measured(monkeypatch, reference):
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")  # forced wins over the check
    with Engine(EngineConfig(dtype="bfloat16", knobs=Knobs(process_count=1, max_batch_size=8))) as eng:
        choice = eng.dtype_choice
        assert eng.dtype == "bfloat16" and "forced" in choice["reason"]
        assert choice["min_cosine"] >= MIN_COSINE and "bf16_speedup" not in choice  # fidelity only, no timing
        vectors = eng.embed(TEXTS[:40]).result(timeout=60).vectors
    assert (vectors * reference).sum(axis=1).min() >= MIN_COSINE


def test_auto_picks_and_reports_its_choice_in_stats_and_metrics(tmp_path, monkeypatch, reference):
    monkeypatch.delenv(NATIVE_BF16_ENV, raising=False)
    config = {"model": {"name": "builtin:minilm", "dtype": "auto"}, "concurrency": {"process_count": 1}, "autotune": {"enabled": False}}
    srv = ServerProcess(tmp_path, config)
    try:
        stats = httpx.get(srv.url + "/stats").json()["model"]
        choice = stats["dtype_choice"]
        assert stats["dtype"] == choice["dtype"] in ("float32", "bfloat16") and choice["requested"] == "auto"
        assert choice["reason"] and 0.9 < choice["min_cosine"] <= 1.0
        if choice["dtype"] == "bfloat16":
            assert choice["native_bf16"] and choice["min_cosine"] >= MIN_COSINE and choice["bf16_speedup"] >= 1.1
        print(f"\nauto chose {choice['dtype']}: {choice['reason']}")
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'dtype="{choice["dtype"]}"' in metrics and 'requested_dtype="auto"' in metrics
        line = next(x for x in metrics.splitlines() if x.startswith("selftune_model_dtype_min_cosine "))
        assert abs(float(line.split()[-1]) - choice["min_cosine"]) < 1e-9
        response = httpx.post(srv.url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": TEXTS[:40]}, timeout=60).json()
        vectors = np.array([d["embedding"] for d in response["data"]], dtype=np.float32)
        assert (vectors * reference).sum(axis=1).min() >= MIN_COSINE  # the Done-when bar, against sentence-transformers
        assert f"model backend {choice['backend']}, dtype {choice['dtype']}" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
