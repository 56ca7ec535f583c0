"""The CPU references the served answers are held to, computed in this process with transformers.

Embeddings: float32 forward, mean pooling over the attention mask, L2 normalisation (what
sentence-transformers computes for all-MiniLM-L6-v2). Generation: greedy decoding at float32
(the model's own KV cache), the EOS ignored, so each prompt gives exactly `GEN_TOKENS` tokens,
with the margin between the best and second-best log-probability at every step (a small
margin would make a mismatch a near-tie rather than a bug). torch and transformers are
imported here, after the install step.
"""

from __future__ import annotations

EMBED_MODEL = "builtin:minilm"
GEN_MODEL = "builtin:smollm2"
EMBED_TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "selftune tunes itself while it serves",
    "a",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Embeddings map sentences to vectors; similar sentences land close together. " * 6,
    "GPUs run many small matrix products at once.",
    "Batching stops paying at about sixteen short inputs on two cores.",
    "The weather today is sunny with a light breeze from the west.",
    "numbers 1 2 3 4 5 6 7 8 9 10 11 12",
    "Ünïcödé text, emojis 🙂 and punctuation!?",
] + [f"sentence number {i} about topic {i % 5} " * (1 + i % 4) for i in range(8)]
# Greedy margins of these on the CPU (float32): all above 0.14 nats over 16 tokens.
GEN_PROMPTS = ["1, 2, 3, 4, 5,", "The capital of France is", "The largest planet in the solar system is"]
GEN_TOKENS = 16


def _setup() -> None:
    """Half the usable CPUs (at most 8: on a small shared machine a full OpenMP pool stalls);
    no progress bars or deprecation notes from transformers in the check's output."""
    import os

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(max(1, min(8, len(os.sched_getaffinity(0)) // 2)))
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def model_dir(spec: str) -> str:
    from engine.config import EngineConfig
    from engine.model_source import resolve_model

    return resolve_model(spec, EngineConfig().cache_dir).path


def embeddings(texts: list[str] = EMBED_TEXTS) -> list[list[float]]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    path = model_dir(EMBED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state.float()
    weights = batch["attention_mask"].unsqueeze(-1).float()
    vectors = F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9), p=2, dim=1)
    return vectors.tolist()


def greedy(prompts: list[str] = GEN_PROMPTS, steps: int = GEN_TOKENS) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(GEN_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        tokens, margins = _greedy_steps(model, ids, steps)
        out.append({
            "prompt": prompt,
            "prompt_tokens": len(ids),
            "tokens": tokens,
            "token_texts": [tokenizer.decode([t]) for t in tokens],
            "text": tokenizer.decode(tokens),
            "min_margin": round(min(margins), 4),
        })
    return out


def _greedy_steps(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens with the model's own KV cache, and the top-1/top-2 margin at each step."""
    import warnings

    import torch

    tokens, margins, cache, step_input = [], [], None, torch.tensor([ids])
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values: renamed in later transformers
        for _ in range(steps):
            output = model(step_input, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            top = torch.log_softmax(output.logits[0, -1].float(), dim=-1).topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            step_input = torch.tensor([[tokens[-1]]])
    return tokens, margins


def compute() -> dict:
    """Both references, as plain data (written to OUT/reference.json)."""
    _setup()
    return {"embed": {"model": EMBED_MODEL, "texts": EMBED_TEXTS, "vectors": embeddings()},
            "generate": {"model": GEN_MODEL, "tokens_per_prompt": GEN_TOKENS, "prompts": greedy()}}
