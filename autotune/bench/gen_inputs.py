"""Generation requests for benchmarks: prompt and output lengths drawn from an LLM trace, prompts built to length with the model's tokenizer.

Lengths are pairs (ContextTokens, GeneratedTokens) of the Azure LLM conversation trace, drawn
with a seed and clipped; each prompt is seeded words that the model's own tokenizer turns into
exactly the drawn number of tokens, so every mode gets the same requests and the server's
prompt_tokens equals the drawn length.
"""

from __future__ import annotations

import csv
import json
import os
import random

import numpy as np

from autotune.bench.inputs import _WORDS

DEFAULT_TRACE = "tests/fixtures/traces/azure_llm_conv_2023_first120s.csv"


def locate(path: str) -> str:
    """`path` as given when it exists, else relative to the project's directory (a checkout's tests/fixtures)."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(project, path)


def read_lengths(path: str) -> np.ndarray:
    """[(ContextTokens, GeneratedTokens)] of every row of an Azure LLM trace CSV."""
    with open(locate(path), encoding="utf-8", newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return np.array(rows, dtype=int)


def draw_lengths(table: np.ndarray, n: int, seed: int, max_prompt: int, max_output: int, min_prompt: int = 1) -> list[tuple[int, int]]:
    """`n` (prompt, output) pairs drawn with replacement from the trace's rows; outputs clipped
    to [1, max_output], prompts to [min_prompt, max_prompt] (the caller fits max_prompt to
    the model's context minus max_output)."""
    rows = table[np.random.default_rng(seed).integers(0, len(table), size=n)]
    prompts = np.clip(rows[:, 0], min_prompt, max(min_prompt, max_prompt))
    outputs = np.clip(rows[:, 1], 1, max_output)
    return list(zip(prompts.tolist(), outputs.tolist()))


class PromptBuilder:
    """Texts of an exact token count for one tokenizer (special tokens it adds included)."""

    def __init__(self, tokenizer):
        from engine.loading import token_ids

        self._ids = lambda text: token_ids(tokenizer, [text])[0]  # as the server tokenizes a prompt
        self.specials = len(self._ids("the")) - 1
        # words this tokenizer keeps as one token after a space: then n words are n tokens
        self.words = [w for w in _WORDS if len(self._ids("the " + w)) == self.specials + 2] or list(_WORDS)

    def count(self, text: str) -> int:
        return len(self._ids(text))

    def text(self, tokens: int, seed: int) -> str:
        """Seeded words that tokenize to `tokens` ids (to the nearest the tokenizer allows when it cannot be exact)."""
        rng = random.Random(seed)
        words = rng.choices(self.words, k=max(1, tokens - self.specials))
        for _ in range(8):  # a word that merges or splits at a boundary: adjust and recount
            have = self.count(" ".join(words))
            if have == tokens:
                break
            if have < tokens:
                words += rng.choices(self.words, k=tokens - have)
            elif len(words) > 1:
                del words[max(1, len(words) - (have - tokens)):]
        return " ".join(words)


def bodies(builder: PromptBuilder, pairs: list[tuple[int, int]], model: str, api: str, seed: int, ignore_eos: bool = True) -> list[bytes]:
    """One streamed request per (prompt, output) pair: greedy, EOS ignored, so every output has its
    drawn length (`ignore_eos` False: the drawn length is a ceiling, the model may stop sooner)."""
    out = []
    for i, (prompt_tokens, output_tokens) in enumerate(pairs):
        text = builder.text(prompt_tokens, seed * 1_000_003 + i)
        request = {"model": model, "max_tokens": output_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                   **({"ignore_eos": True} if ignore_eos else {})}
        if api == "chat":
            request["messages"] = [{"role": "user", "content": text}]
        else:
            request["prompt"] = text
        out.append(json.dumps(request).encode())
    return out


def path_of(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"
