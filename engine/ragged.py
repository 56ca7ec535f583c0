"""One model call over a ragged batch: the running rows' next tokens beside prompts (or a chunk of
one) being prefilled, each part attending over its own KV cache.

On a CPU a small model's forward costs about as much as reading its weights once, however few
tokens it carries, so a continuous-batching step that prefilled in one call and decoded in another
paid for the weights twice. Here the parts' tokens go through the model flattened into one row
(with a position id per token), so the projections and MLPs run once per step; only attention is
split by part, in the attention function registered below, each part against its own cache:

* the decode part: one query per running row against the dense left-padded cache, padding masked;
* a prefill part: one sequence's new tokens against its earlier chunks and themselves, causal.

`StepCache` is the cache the model sees for that one call: its `update` appends each part's new
keys and values to the part's own cache and hands the attention function all of them, per part.
Any other call of a model switched by `enable` runs transformers' own sdpa attention, only
computed in fp32 on a CPU when the model is in bf16 or fp16 (`_sdpa`), as the parts are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

RAGGED = "selftune_ragged"


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a ragged step and the cache its keys and values go to."""

    cache: DynamicCache | None
    """None: padding (see `padded_tokens`), attending over itself and written to no cache."""
    tokens: int
    """Queries this part brings: one per running row (decode), or the prompt chunk's length."""
    decode: bool
    """One query per cache row (the running rows); else one sequence's consecutive tokens."""
    mask: torch.Tensor | None
    """Bool, True = attend, [rows, 1, queries, keys]; None: causal over this part alone (a prompt from its start)."""


class _PerPart:
    """What `StepCache.update` hands the attention function: every part's keys (or values)."""

    __slots__ = ("parts", "tensors")

    def __init__(self, parts: Sequence[Part], tensors: list[torch.Tensor]):
        self.parts, self.tensors = parts, tensors


class StepCache:
    """The model's cache for one ragged call: splits each layer's new keys and values by part."""

    def __init__(self, parts: Sequence[Part]):
        self.parts = parts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values, start = [], [], 0
        for part in self.parts:
            k = key_states[:, :, start:start + part.tokens]
            v = value_states[:, :, start:start + part.tokens]
            start += part.tokens
            if part.decode:  # [1, heads, rows, dim] -> [rows, heads, 1, dim], the running cache's layout
                k, v = k.permute(2, 1, 0, 3), v.permute(2, 1, 0, 3)
            if part.cache is not None:
                k, v = part.cache.update(k, v, layer_idx)
            keys.append(k)
            values.append(v)
        return _PerPart(self.parts, keys), _PerPart(self.parts, values)


def _sdpa(module, query, key, value, mask, **kwargs):
    """transformers' sdpa; on a CPU in bf16 or fp16 computed in fp32 and cast back. torch's CPU
    kernel for half-precision attention is several times slower than fp32's on decode queries
    (docs/BENCHMARKS.md, "Generation in bf16"), and never faster on prompts; the conversion
    costs less than the difference."""
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16):
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), weights


def ragged_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa per part of a ragged call; any other call is plain sdpa."""
    if not isinstance(key, _PerPart):
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    outputs, start = [], 0
    for part, k, v in zip(key.parts, key.tensors, value.tensors):
        q = query[:, :, start:start + part.tokens]
        start += part.tokens
        if part.decode:
            q = q.permute(2, 1, 0, 3)
        out, _ = _sdpa(module, q, k, v, part.mask, **kwargs)  # [rows, queries, heads, dim]
        outputs.append(out.reshape(1, part.tokens, *out.shape[2:]))
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(RAGGED, ragged_attention)
# Outside a ragged call the model builds its masks as for sdpa; a ragged call passes a 4-D
# placeholder, which transformers returns as it is, and the parts carry their own masks.
AttentionMaskInterface.register(RAGGED, sdpa_mask)
_PLACEHOLDER_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def enable(model) -> bool:
    """Switch a model whose attention runs transformers' sdpa to the ragged attention; False
    (the model unchanged) for any other attention, whose steps then make one call per part."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == RAGGED:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    try:
        model.set_attn_implementation(RAGGED)
    except (ValueError, ImportError, NotImplementedError):
        return False
    return config._attn_implementation == RAGGED


def causal_after(past: int, queries: int, device) -> torch.Tensor | None:
    """A prefill part's mask: each of `queries` new tokens sees the `past` cached ones and the new
    ones up to itself (None when there is no past: plain causal)."""
    if past == 0:
        return None
    return torch.ones((queries, past + queries), dtype=torch.bool, device=device).tril(diagonal=past)[None, None]


EXACT_TOKENS = 16
"""Steps of up to this many tokens run at their own size (decode steps of a few rows: most steps)."""
SIZES_PER_DOUBLING = 8


def padded_tokens(tokens: int) -> int:
    """The size a ragged call of `tokens` tokens runs at: itself up to EXACT_TOKENS, else rounded up
    to one of SIZES_PER_DOUBLING sizes between two powers of two (at most 1/8 more rows).

    oneDNN compiles a kernel per matmul shape and keeps 1,024 of them (ONEDNN_PRIMITIVE_CACHE_CAPACITY);
    a model's half-dozen Linear shapes times every row count a step can have (running rows plus
    a chunk: up to 288 at batch 32, chunk 256) passes that, and each miss compiles again: a bf16
    step grew slower and slower (docs/BENCHMARKS.md, "oneDNN's primitive cache"). With these sizes
    a step up to 2,048 tokens has 72 row counts."""
    if tokens <= EXACT_TOKENS:
        return tokens
    step = (1 << (tokens - 1).bit_length()) // (2 * SIZES_PER_DOUBLING)  # >= 2: tokens > 16 here
    return -(-tokens // step) * step


def forward(model, cache_kwarg: str, ids: torch.Tensor, positions: torch.Tensor, parts: Sequence[Part],
            keep: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """One call of a model `enable` switched over the flattened parts ([1, tokens] ids and
    positions), padded to `size` tokens (`padded_tokens`) by a part of its own that no cache keeps
    and no logits come from; float32 logits of the `keep` token indices, [len(keep), vocab]."""
    pad = (size or ids.shape[1]) - ids.shape[1]
    if pad:
        filler = torch.zeros((1, pad), dtype=ids.dtype, device=ids.device)
        ids, positions = torch.cat([ids, filler], dim=1), torch.cat([positions, filler], dim=1)
        parts = [*parts, Part(None, pad, False, None)]
    out = model(
        input_ids=ids,
        attention_mask=_PLACEHOLDER_MASK,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=keep,
        **{cache_kwarg: StepCache(parts)},
    )
    return out.logits[0].float()
