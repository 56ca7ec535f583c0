"""model.backend for embeddings: ONNX Runtime beside torch. The decision (pure), the export and
its cache, the ORT runner against torch fp32, and a real engine serving through ORT with a live
thread change."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import minilm_dir

from autotune.bench.inputs import sentences
from autotune.settings import ConfigError, load_config
from engine.config import EngineConfig, Knobs
from engine.embedding import PROBE_TEXTS, BackendError, EmbeddingRunner, _batch, decide_backend
from engine.engine import Engine
from engine.loading import MIN_COSINE, load_model, load_tokenizer, token_ids
from engine.onnx_embedding import OnnxEmbeddingRunner, export, export_path, served_name

pytest.importorskip("onnxruntime", reason="the `onnx` extra is not installed")

TEXTS = list(PROBE_TEXTS) + sentences(24, seed=31) + ["a", "ok?"]


# ---- the decision (pure) ------------------------------------------------------------------------


def _choice(dtype="bfloat16", bf16_speedup=1.7, requested="auto"):
    return {"requested": requested, "dtype": dtype, "mode": "bf16-mixed" if dtype == "bfloat16" else "fp32",
            "reason": "native bf16", "min_cosine": 0.99995 if dtype == "bfloat16" else 1.0, "bf16_speedup": bf16_speedup}


def _probe(cosine=0.9999999, speedup=1.0):
    return {"others": {"onnxruntime": {"min_cosine": cosine, "ms": [10.0, 11.0, 10.5], "speedup": speedup}}}


def test_auto_takes_onnxruntime_only_when_faithful_and_faster_than_the_torch_choice():
    # Faster than torch fp32 by 1.4x, and torch chose fp32: ONNX Runtime.
    picked = decide_backend("auto", _choice("float32"), _probe(speedup=1.4))
    assert picked["backend"] == "onnxruntime" and picked["dtype"] == "float32" and picked["mode"] == "onnxruntime-fp32"
    assert picked["min_cosine"] == 0.9999999 and "1.40x torch float32" in picked["reason"]
    assert served_name(picked) == "onnxruntime"
    # Faster than fp32 (1.4x) but not than the bf16 torch chose (1.7x fp32): torch bf16 stays.
    kept = decide_backend("auto", _choice("bfloat16", 1.7), _probe(speedup=1.4))
    assert kept["backend"] == "torch" and kept["dtype"] == "bfloat16" and "0.82x the torch choice" in kept["reason"]
    assert kept["onnxruntime_speedup"] == 1.4 and served_name(kept) == "bfloat16"
    # A tie is not worth a second backend; an unfaithful one never serves.
    assert decide_backend("auto", _choice("float32"), _probe(speedup=1.05))["backend"] == "torch"
    unfaithful = decide_backend("auto", _choice("float32"), _probe(cosine=0.9995, speedup=3.0))
    assert unfaithful["backend"] == "torch" and "onnxruntime cosine 0.999500" in unfaithful["reason"]
    # Not installed or not exportable: torch serves, and says why.
    missing = decide_backend("auto", _choice("float32"), None, error="onnxruntime is not installed")
    assert missing["backend"] == "torch" and "onnxruntime not used (onnxruntime is not installed)" in missing["reason"]


def test_a_named_dtype_or_backend_is_kept():
    # model.dtype float32 names torch's fp32: auto does not swap the backend under it.
    assert decide_backend("auto", _choice("float32", requested="float32"), _probe(speedup=2.0))["backend"] == "torch"
    assert decide_backend("torch", _choice("float32"), _probe(speedup=2.0))["backend"] == "torch"
    forced = decide_backend("onnxruntime", _choice("bfloat16"), _probe(speedup=0.3))
    assert forced["backend"] == "onnxruntime" and forced["dtype"] == "float32" and "forced" in forced["reason"]
    with pytest.raises(BackendError, match="onnxruntime cannot be served: onnxruntime is not installed"):
        decide_backend("onnxruntime", _choice("float32"), None, error="onnxruntime is not installed")


def test_config_refuses_onnxruntime_where_it_cannot_run(tmp_path):
    path = tmp_path / "c.yaml"
    for model, words in (({"dtype": "bfloat16"}, "dtype: bfloat16 needs backend: torch"),
                         ({"task": "generate"}, "serves embeddings only"),
                         ({"device": "cuda"}, "device: cuda needs backend: torch")):
        path.write_text("model:\n  backend: onnxruntime\n" + "".join(f"  {k}: {v}\n" for k, v in model.items()))
        with pytest.raises(ConfigError, match=f"(?s){path}.*model: .*{words}"):
            load_config(path)
    path.write_text("model:\n  backend: tensorrt\n")
    with pytest.raises(ConfigError, match="backend"):
        load_config(path)
    path.write_text("model:\n  backend: onnxruntime\n  dtype: float32\n")
    assert load_config(path).engine_config().backend == "onnxruntime"


# ---- the export and the runner, in-process ------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.set_num_threads(1)
    path = minilm_dir()
    model = load_model(path, "embed", torch.float32)
    onnx = export_path(path, str(tmp_path_factory.mktemp("cache")))
    export(model, onnx)
    return path, model, onnx


def _run(runner, ids) -> np.ndarray:
    matrix, lengths = _batch(ids)
    out = np.empty((len(ids), 384), dtype=np.float32)
    runner.run(matrix, lengths, out)
    return out


def test_export_is_made_once_and_keyed_on_the_model_and_torch(exported, tmp_path):
    path, model, onnx = exported
    assert os.path.getsize(onnx) > 50_000_000 and not [f for f in os.listdir(os.path.dirname(onnx)) if f.endswith(".tmp")]
    mtime = os.stat(onnx).st_mtime_ns
    export(model, onnx)  # cached: not written again
    assert os.stat(onnx).st_mtime_ns == mtime
    assert export_path(path, os.path.dirname(os.path.dirname(os.path.dirname(onnx)))) == onnx
    copy = tmp_path / "model"  # another model directory (different files): another key
    copy.mkdir()
    (copy / "config.json").write_text("{}")
    assert export_path(str(copy), "/c") != export_path(path, "/c")


def test_the_onnxruntime_runner_matches_torch_fp32_at_any_thread_count(exported):
    path, model, onnx = exported
    ids = token_ids(load_tokenizer(path), TEXTS)
    want = np.concatenate([_run(EmbeddingRunner(model, "cpu", 0), [x]) for x in ids])  # each alone, fp32
    runner = OnnxEmbeddingRunner(onnx, threads=1)
    assert runner.hidden_size == 384
    for threads in (1, 2, 1):
        runner.set_threads(threads)
        assert runner.threads == threads and runner.session.get_session_options().intra_op_num_threads == threads
        got = np.concatenate([_run(runner, ids[i : i + 8]) for i in range(0, len(ids), 8)])  # padded batches
        assert np.abs(got - want).max() < 1e-4
        assert (got * want).sum(axis=1).min() >= MIN_COSINE
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


# ---- a real engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir(), device="cpu").encode(TEXTS, batch_size=64)


def test_forced_onnxruntime_serves_and_follows_a_live_thread_change(monkeypatch, tmp_path, reference, capfd):
    monkeypatch.setenv("SELFTUNE_CACHE", str(tmp_path))  # the export goes to this test's cache
    with Engine(EngineConfig(backend="onnxruntime", knobs=Knobs(process_count=1, max_batch_size=8))) as eng:
        choice = eng.dtype_choice
        assert choice["backend"] == "onnxruntime" and eng.dtype == "float32" and "forced" in choice["reason"]
        assert choice["min_cosine"] >= MIN_COSINE and choice["onnx_path"].startswith(str(tmp_path))
        assert os.path.exists(choice["onnx_path"])
        first = eng.embed(TEXTS).result(timeout=60).vectors
        eng.apply(Knobs(process_count=1, threads_per_process=2, max_batch_size=8))
        second = eng.embed(TEXTS).result(timeout=60).vectors
        assert eng.stats().knobs.threads_per_process == 2
    assert "ONNX Runtime session reopened with 2 threads (was 1)" in capfd.readouterr().err  # the worker's own log
    for vectors in (first, second):
        assert (vectors * reference).sum(axis=1).min() >= MIN_COSINE  # against sentence-transformers fp32
        assert np.abs(vectors - reference).max() < 1e-4


def test_a_named_torch_dtype_skips_the_probe_and_is_loaded_as_named():
    """backend auto with dtype float16 (or float32) is torch at that dtype: no probe, no export."""
    from engine.zygote import load_for_serving

    threads = torch.get_num_threads()
    try:
        model, device, choice = load_for_serving(minilm_dir(), "embed", "cpu", "float16", "auto", "/nonexistent")
    finally:
        torch.set_num_threads(threads)
    assert next(model.parameters()).dtype == torch.float16 and device == "cpu"
    assert choice["backend"] == "torch" and choice["dtype"] == "float16" and choice["mode"] == "cast" and "forced" in choice["reason"]
