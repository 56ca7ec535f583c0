"""Loading models and tokenizers from a local directory, and choosing device and dtype.

Everything here reads disk only: the server never downloads a model at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the front process needs to know about a model without loading its weights."""

    hidden_size: int
    max_length: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    vocab_size: int


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device={device!r}: expected auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str, device: str):
    """float32 on CPU; bfloat16 on CUDA where supported, else float16; or what was asked."""
    import torch

    if dtype != "auto":
        try:
            return getattr(torch, dtype)
        except AttributeError:
            raise ValueError(f"dtype={dtype!r}: expected auto, float32, bfloat16 or float16") from None
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(path: str, task: str, dtype):
    """The model on the CPU, in eval mode; a worker moves it to its device after the fork."""
    from transformers import AutoModel, AutoModelForCausalLM

    cls = AutoModel if task == "embed" else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, special tokens added, nothing truncated or padded.

    A fast tokenizer's Rust backend is called directly: transformers' `__call__` around it
    (argument checks, a BatchEncoding) costs as much CPU again per request, in the front
    process that shares the cores with the workers. The backend is used only while it has no
    truncation or padding set (transformers' own call clears both when asked for none).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    if len(texts) == 1:
        return [backend.encode(texts[0], add_special_tokens=True).ids]
    return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=True)]


def model_info(path: str, tokenizer) -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text_config, "hidden_size", None) or getattr(text_config, "n_embd")
    limits = [
        getattr(text_config, name, None)
        for name in ("max_position_embeddings", "n_positions", "max_seq_len")
    ]
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit < 1_000_000:
        limits.append(tokenizer_limit)
    max_length = min(x for x in limits if x) if any(limits) else 512
    eos = _eos_ids(path, config, tokenizer, GenerationConfig)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    vocab = getattr(text_config, "vocab_size", None) or len(tokenizer)
    return ModelInfo(
        hidden_size=int(hidden), max_length=int(max_length), eos_token_ids=eos, pad_token_id=int(pad), vocab_size=int(vocab)
    )


def _eos_ids(path, config, tokenizer, generation_config_cls) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        gen = generation_config_cls.from_pretrained(path)
        ids += _as_list(gen.eos_token_id)
    except OSError:
        pass
    ids += _as_list(getattr(config, "eos_token_id", None))
    ids += _as_list(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
