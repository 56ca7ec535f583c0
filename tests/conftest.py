"""Shared fixtures: real models on disk, and checks that nothing is left running."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def minilm_dir() -> str:
    from engine.model_source import resolve_model

    return resolve_model("builtin:minilm", cache_dir="/nonexistent").path


@pytest.fixture(scope="session")
def tiny_causal_lm(tmp_path_factory) -> str:
    """A small GPT-2-style model built from a config and saved like any model directory.

    It borrows MiniLM's tokenizer (so text prompts work) and is loaded back through the
    normal path by whoever uses it.
    """
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=tokenizer.vocab_size,
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    GPT2LMHeadModel(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def shm_entries():
    """The /dev/shm listing before a test; compare after to prove nothing leaked."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

