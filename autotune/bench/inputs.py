"""Input texts for benchmarks: deterministic sentences of a chosen length, from a seed.

Every mode and every run of a benchmark gets the same texts for the same seed, so their
numbers compare the servers, not the inputs.
"""

from __future__ import annotations

import random

_WORDS = (
    "the a small large quick slow red blue green old new good bad first last long short high low "
    "city river house garden market school train window table water light music paper street "
    "road bridge forest mountain village ocean island family friend teacher doctor student "
    "runs walks reads writes builds opens closes finds keeps makes takes gives sees hears "
    "today always never often early later near under over after before with without from into"
).split()


def texts_of_tokens(tokenizer, n: int = 512, tokens: int = 16, seed: int = 0) -> list[str]:
    """`n` distinct sentences that tokenize to exactly `tokens` ids (with [CLS]/[SEP])."""
    rng = random.Random(seed)
    texts: list[str] = []
    seen: set[str] = set()
    while len(texts) < n:
        words = rng.choices(_WORDS, k=tokens - 2)
        text = " ".join(words).capitalize() + "."
        if text in seen:
            continue
        if len(tokenizer(text)["input_ids"]) == tokens:
            texts.append(text)
            seen.add(text)
        else:  # drop the final period if that is what overshoots
            text = text[:-1]
            if text not in seen and len(tokenizer(text)["input_ids"]) == tokens:
                texts.append(text)
                seen.add(text)
    return texts


def sentences(n: int, min_words: int = 8, max_words: int = 48, seed: int = 0) -> list[str]:
    """`n` sentences of a uniformly random word count in [min_words, max_words]."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))).capitalize() + "." for _ in range(n)]


def sentence_of_tokens(tokens: int, seed: int) -> str:
    """About `tokens` MiniLM tokens (one word of this vocabulary is one token, plus [CLS]/[SEP])."""
    rng = random.Random(seed)
    return " ".join(rng.choices(_WORDS, k=max(1, tokens - 2)))
