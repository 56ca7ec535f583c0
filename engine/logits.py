"""Per-row logits processing for generation: penalties, bans and bias, then greedy or sampled
tokens (temperature, top-k, top-p, a generator per sequence), and log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling import SamplingParams, TokenLogprobs


def adjust_row(row: torch.Tensor, seq) -> None:
    """Apply one sequence's penalties, logit bias and min_tokens ban to its row of logits, in place
    (`seq` has request.params, request.prompt_ids, output_ids, num_generated, banned_early)."""
    params = seq.request.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.request.prompt_ids) | set(seq.output_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if seq.output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(seq.output_ids, device=row.device).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        row[torch.tensor(ids, device=row.device)] += torch.tensor(biases, device=row.device, dtype=row.dtype)
    if seq.banned_early and seq.num_generated < params.min_tokens:
        row[torch.tensor(sorted(seq.banned_early), device=row.device)] = -float("inf")


def logprobs_of(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list:
    """Per row: None, or a function token -> TokenLogprobs over the row's raw log-softmax."""
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    found: list = [None] * len(params)
    if not wanted:
        return found
    table = torch.log_softmax(logits.index_select(0, torch.tensor(wanted, device=logits.device)), dim=-1)
    for i, row in enumerate(wanted):
        k = params[row].logprobs
        top = table[i].topk(k) if k else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        found[row] = lambda token, lsm=table[i], alt=alternatives: TokenLogprobs(float(lsm[token]), alt)
    return found


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Greedy rows take the argmax; the others sample from temperature-scaled, top-k- and
    top-p-filtered probabilities with their own generator (one multinomial per row, because a
    generator belongs to one sequence)."""
    tokens = logits.argmax(dim=-1)
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[r].temperature for r in sampled], device=logits.device, dtype=logits.dtype)
        probs = torch.softmax(logits.index_select(0, index) / temps[:, None], dim=-1)
        for i, row in enumerate(sampled):
            k = params[row].top_k
            if 0 < k < probs.shape[-1]:
                kth = probs[i].topk(k).values[-1]
                probs[i] = probs[i].masked_fill(probs[i] < kth, 0.0)
        top_p = [params[r].top_p for r in sampled]
        if any(p < 1.0 for p in top_p):
            probs = _top_p_filter(probs, torch.tensor(top_p, device=logits.device, dtype=probs.dtype))
        for i, row in enumerate(sampled):
            tokens[row] = torch.multinomial(probs[i], 1, generator=generators[row])[0]
    return tokens.tolist()


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus; the most likely token always survives.

    Rows with top_p == 1 are left untouched (rounding in the cumulative sum could otherwise
    drop their least likely tokens)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
