"""Continuous-batching decode loop for a Hugging Face causal LM.

`GenerationRunner` runs inside a worker process. It keeps every running sequence in one
batched KV cache so that each `step()` costs a single forward pass however many sequences
are running, and it lets sequences join and leave that batch at step boundaries
("continuous batching") instead of waiting for the slowest member of a static batch.

Layout of the running batch (why it looks like this):

* The cache is a transformers `DynamicCache` of full-attention layers whose key/value tensors
  have shape ``[rows, heads, columns, head_dim]`` (engine/kv_cache.py: a step's column is written
  in place, not concatenated). Rows are running sequences.
  Sequences have different lengths, so shorter rows are padded **on the left**: the newest
  token of every row then sits in the last column, a decode step appends exactly one column
  for all rows, and the model's causal mask stays valid.
* ``_mask`` (``[rows, columns]``, 1 = real token, 0 = padding) is passed as the 2-D
  ``attention_mask`` so nobody attends to padding.
* Because column index != token position once rows are padded, every forward gets explicit
  per-row ``position_ids`` (GPT-2 learned positions and Llama RoPE both read them).
* A step is one forward pass (engine/ragged.py): the running rows' next tokens, flattened beside
  the prompts joining this step (or the next chunk of a long one), each prompt on a cache of its
  own. Prompts that have finished prefilling are merged by left-padding whichever side is
  shorter; finished rows are dropped by index-selecting rows and trimming leading columns that
  are padding in every remaining row, so the cache never carries columns nobody needs.

KV memory is bounded: the dense cache holds rows × columns token slots (padding included),
and `kv_tokens` caps them. Who joins and who is preempted is decided in engine/gen_admission.py
(pure arithmetic on lengths, which the simulator drives too): a sequence is admitted only when
the batch it joins still has `KV_RESERVE` slots per row free; when a decode step would pass the
cap, the youngest rows are preempted (dropped from the cache, put back at the head of the queue) and later re-prefilled
over their prompt and the tokens they had made (recompute), so a stream never repeats or
loses a token and memory never grows past the cap.

Everything here is plain torch: no I/O, threads, clocks or sleeping. Not supported:
sliding-window / linear-attention caches (all layers are treated as full attention, which
stays correct for GPT-2- and Llama-style models) and models without a KV cache.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import ragged
from engine.gen_admission import KV_RESERVE, admit, chunk_end, preemptions, prefills_in_chunks, step_budget
from engine.kv_cache import KVCache
from engine.logits import adjust_row, logprobs_of, sample_tokens
from engine.sampling import SamplingParams, TokenLogprobs

__all__ = ["KV_RESERVE", "GenerationRunner", "SamplingParams", "SequenceRequest", "TokenOutput"]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True, slots=True)
class SequenceRequest:
    """One sequence to generate: the caller's id, the tokenized prompt and its sampling params."""

    seq_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One generated token; `finish_reason` is set on a sequence's last token only."""

    seq_id: int
    token_id: int
    finish_reason: str | None
    """None while running; "stop" (EOS or a stop token, which is still reported) or "length"."""
    logprobs: TokenLogprobs | None = None
    """Set when the sequence's params ask for log-probabilities."""


class _Sequence:
    """Mutable per-sequence state the runner keeps between steps."""

    __slots__ = ("request", "generator", "output_ids", "last_token", "stop_ids", "banned_early")

    def __init__(self, request: SequenceRequest, generator: torch.Generator | None, eos: frozenset[int]):
        params = request.params
        self.request = request
        self.generator = generator
        self.output_ids: list[int] = []
        """Generated so far; the penalties read it."""
        self.last_token = -1
        """Newest sampled token: not yet in the KV cache, it is the next decode step's input."""
        stop = frozenset(int(t) for t in params.stop_token_ids)
        self.stop_ids = stop if params.ignore_eos else eos | stop
        self.banned_early = eos | stop if params.min_tokens else frozenset()
        """Masked out of the logits until min_tokens tokens have been generated."""

    @property
    def seq_id(self) -> int:
        return self.request.seq_id

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What a (re-)prefill runs over: the prompt, and the tokens made before a preemption."""
        return self.request.prompt_ids + tuple(self.output_ids)

    @property
    def next_position(self) -> int:
        """Position id of `last_token`, i.e. the number of tokens already in the cache."""
        return len(self.request.prompt_ids) + self.num_generated - 1

    def accept(self, token: int, logprobs: TokenLogprobs | None = None) -> TokenOutput:
        """Record a sampled token and decide whether it finishes the sequence."""
        self.output_ids.append(token)
        self.last_token = token
        reason = None
        if token in self.stop_ids:
            reason = FINISH_STOP
        elif self.num_generated >= self.request.params.max_tokens:
            reason = FINISH_LENGTH
        return TokenOutput(self.seq_id, token, reason, logprobs)


class _Prefill:
    """A sequence whose context is being prefilled on a cache of its own, `done` tokens so far
    (a whole short prompt in one step, or a long one a chunk per step)."""

    __slots__ = ("seq", "cache", "done")

    def __init__(self, seq: _Sequence):
        self.seq, self.cache, self.done = seq, KVCache(), 0


class GenerationRunner:
    """Continuous-batching generation over one model; the worker calls `step()` in a loop.

    `add` and `abort` may be called between steps; admissions happen at the start of the next
    `step`. `max_running` is the live max_batch_size knob: lowering it never evicts running
    sequences, it only holds back admissions until enough of them have finished.
    """

    def __init__(self, model, eos_token_ids: Iterable[int], max_running: int = 16, kv_tokens: int | None = None,
                 prefill_chunk: int | None = None, kv_ceiling: int | None = None):
        self._model = model
        self.kv_tokens = kv_tokens
        """Cap on the cache's token slots (rows × columns); None: no cap. Live: lowering it
        preempts the youngest rows at the next step (one row alone may still pass it)."""
        self.kv_ceiling = kv_tokens if kv_ceiling is None else kv_ceiling
        """What `add` checks a sequence against: the most the cap may ever be, so lowering the
        cap live never turns a queued request into an error."""
        self.prefill_chunk = prefill_chunk
        """Most prompt tokens one step prefills; a longer prompt is prefilled over several steps
        while the running rows keep decoding (None: whole prompts at once)."""
        self.preemptions = 0
        param = next(model.parameters())
        self._device = param.device
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self.max_running = max_running
        # transformers 5.x renamed the forward kwarg `past_key_values` -> `cache` (the old name
        # still works until 5.40 but warns); pick whichever this model's forward declares.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._max_positions = _max_positions(model)
        self._fused = ragged.enable(model)
        """One model call per step, however many parts (engine/ragged.py); else one per part."""
        self._padded = self._fused and self._device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float16)
        """Steps run at ragged.padded_tokens' sizes: oneDNN's half-precision kernels are compiled per shape."""

        self._waiting: OrderedDict[int, _Sequence] = OrderedDict()
        self._rows: list[_Sequence] = []  # running sequences, in cache row order
        self._cache: KVCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, columns] long, 1 = real token
        self._partial: _Prefill | None = None  # a long prompt part-way through its chunked prefill

    # ----------------------------------------------------------------- public API

    @property
    def max_running(self) -> int:
        """Most sequences in the running batch; admission stops at this, nothing is evicted."""
        return self._max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_running must be an int >= 1, got {value!r}")
        self._max_running = value

    @property
    def num_running(self) -> int:
        return len(self._rows) + (self._partial is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefilling(self) -> bool:
        """A prompt is being prefilled a chunk per step, beside the running rows."""
        return self._partial is not None

    @property
    def kv_tokens_used(self) -> int:
        """Token slots the cache holds now: rows × columns, padding included."""
        partial = 0 if self._partial is None else self._partial.done
        return partial + (0 if self._mask is None else int(self._mask.shape[0] * self._mask.shape[1]))

    @property
    def has_work(self) -> bool:
        """True while a `step()` could produce output (something is running or waiting)."""
        return bool(self._rows or self._waiting or self._partial)

    def add(self, request: SequenceRequest) -> None:
        """Queue a sequence; it is prefilled when a `step()` finds a free slot (FIFO)."""
        partial = self._partial.seq.seq_id if self._partial is not None else None
        if request.seq_id in self._waiting or request.seq_id == partial or any(s.seq_id == request.seq_id for s in self._rows):
            raise ValueError(f"seq_id {request.seq_id} is already queued or running")
        if len(request.prompt_ids) == 0:
            raise ValueError("prompt_ids must not be empty")
        total = len(request.prompt_ids) + request.params.max_tokens
        if self._max_positions is not None and total > self._max_positions:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)}) + max_tokens ({request.params.max_tokens}) exceeds "
                f"the model's context of {self._max_positions} positions"
            )
        if self.kv_ceiling is not None and total > self.kv_ceiling:
            raise ValueError(f"prompt + max_tokens ({total}) exceeds the KV cache's {self.kv_ceiling} token slots")
        self._waiting[request.seq_id] = _Sequence(request, self._make_generator(request.params), self._eos)

    def abort(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence; False if it is unknown (or already finished)."""
        if self._waiting.pop(seq_id, None) is not None:
            return True
        if self._partial is not None and self._partial.seq.seq_id == seq_id:
            self._partial = None
            return True
        for row, seq in enumerate(self._rows):
            if seq.seq_id == seq_id:
                self._retire([row])
                return True
        return False

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Admit waiting sequences up to max_running, then one forward pass: a token for every
        running row, and the prompts (or the chunk of a long one) prefilling beside them.

        Returns one TokenOutput per sequence that produced a token: a newly admitted
        sequence's first token comes from its prefill, so it is not decoded again this step.
        Finished sequences are retired before returning.
        """
        budget = step_budget(self.prefill_chunk, len(self._rows))
        prefills = self._prefills(budget)
        ends = [chunk_end(p.done, len(p.seq.context_ids), budget) for p in prefills]
        self._preempt_to_fit(prefills, ends)
        if self._rows:
            self._mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=1)
        decode_logits, prefill_logits = self._run(prefills, ends)
        outputs = self._decoded(decode_logits) if self._rows else []
        new_outputs, joining = [], []
        for part, end, logits in zip(prefills, ends, prefill_logits):
            part.done = end
            if end < len(part.seq.context_ids):
                continue
            if part is self._partial:
                self._partial = None
            (output,) = [part.seq.accept(*picked) for picked in self._sample(logits[None], [part.seq])]
            new_outputs.append(output)
            if output.finish_reason is None:
                joining.append(part)
        if joining:
            self._merge(joining)
        return outputs + new_outputs

    # ------------------------------------------------------------ admission/prefill

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        """Per-sequence RNG so a sequence's samples do not depend on its batch neighbours."""
        if params.greedy:
            return None
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        gen = torch.Generator(device=self._device)
        gen.manual_seed(seed)
        return gen

    def _prefills(self, budget: int | None) -> list[_Prefill]:
        """What this step prefills: the next chunk of the partial prompt, or the sequences
        engine.gen_admission lets join (FIFO, the KV cap with its reserve, the step's prefill
        budget), of which a lone long one goes on in chunks."""
        if self._partial is not None:
            return [self._partial]
        columns = 0 if self._mask is None else self._mask.shape[1]
        lengths = [len(s.context_ids) for s in self._waiting.values()]
        count = admit(lengths, len(self._rows), columns, self._max_running, self.kv_tokens, budget)
        admitted = [_Prefill(self._waiting.popitem(last=False)[1]) for _ in range(count)]
        if prefills_in_chunks([len(p.seq.context_ids) for p in admitted], budget):
            self._partial = admitted[0]
        return admitted

    def _preempt_to_fit(self, prefills: list[_Prefill], ends: list[int]) -> None:
        """Before a step adds a column to the running rows (and the prompts it completes, unless
        their first token is their last, merge): drop the youngest rows engine.gen_admission
        names, and queue them first (they re-prefill over what they had made)."""
        joining = [len(p.seq.context_ids) for p, end in zip(prefills, ends)
                   if end == len(p.seq.context_ids) and p.seq.num_generated + 1 < p.seq.request.params.max_tokens]
        partial = next((len(p.seq.context_ids) for p, end in zip(prefills, ends) if end < len(p.seq.context_ids)), None)
        # A row's cached tokens are its next position; the longest of them is the cache's width.
        count = preemptions([s.next_position for s in self._rows], len(joining), max(joining, default=0), partial, self.kv_tokens)
        for _ in range(count):
            seq = self._rows[-1]
            self._retire([len(self._rows) - 1])
            self._waiting[seq.seq_id] = seq
            self._waiting.move_to_end(seq.seq_id, last=False)
            self.preemptions += 1

    def _merge(self, joining: list[_Prefill]) -> None:
        """Append the prefilled sequences to the running batch in one copy, left-padding to the widest."""
        caches = ([self._cache] if self._rows else []) + [p.cache for p in joining]
        masks = ([self._mask] if self._rows else []) + [
            torch.ones((1, p.done), dtype=torch.long, device=self._device) for p in joining]
        width = max(m.shape[1] for m in masks)
        if len(caches) > 1:
            for index, layer in enumerate(caches[0].layers):
                layer.keys = torch.cat([_pad_left(c.layers[index].keys, width) for c in caches], dim=0)
                layer.values = torch.cat([_pad_left(c.layers[index].values, width) for c in caches], dim=0)
        self._cache, self._mask = caches[0], torch.cat([_pad_left(m, width) for m in masks], dim=0)
        self._rows.extend(p.seq for p in joining)

    # ------------------------------------------------------------------- the step's forward

    def _run(self, prefills: list[_Prefill], ends: list[int]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The step's forward: one model call over every part when the model takes ragged calls
        (engine/ragged.py), else one call per part. Returns the running rows' logits and each
        prefill's last-token logits."""
        rows, device = len(self._rows), self._device
        tokens = rows + sum(end - p.done for p, end in zip(prefills, ends))
        size = ragged.padded_tokens(tokens) if self._padded else tokens
        fused = self._fused and (bool(rows) + len(prefills) > 1 or size != tokens)  # one part alone runs plain at its own size
        # The parts' own masks serve only a ragged call; a plain call builds its mask from the 2-D one.
        parts, ids, positions = [], [], []
        if rows:
            ids.append(torch.tensor([s.last_token for s in self._rows], dtype=torch.long, device=device))
            positions.append(torch.tensor([s.next_position for s in self._rows], dtype=torch.long, device=device))
            parts.append(ragged.Part(self._cache, rows, True, self._mask[:, None, None, :].bool() if fused else None))
        for p, end in zip(prefills, ends):
            ids.append(torch.tensor(p.seq.context_ids[p.done:end], dtype=torch.long, device=device))
            positions.append(torch.arange(p.done, end, dtype=torch.long, device=device))
            parts.append(ragged.Part(p.cache, end - p.done, False, ragged.causal_after(p.done, end - p.done, device) if fused else None))
        if fused:
            last = torch.tensor([part.tokens for part in parts]).cumsum(0) - 1
            keep = torch.cat([torch.arange(rows), last[1:]]) if rows else last
            logits = ragged.forward(self._model, self._cache_kwarg, torch.cat(ids)[None], torch.cat(positions)[None], parts, keep.to(device), size)
            return (logits[:rows] if rows else None), list(logits[rows:])
        logits = []
        for part, part_ids, part_positions in zip(parts, ids, positions):
            if part.decode:
                logits.append(self._forward(part_ids[:, None], self._mask, part_positions[:, None], part.cache))
            else:
                mask = torch.ones((1, int(part_positions[-1]) + 1), dtype=torch.long, device=device)
                logits.append(self._forward(part_ids[None], mask, part_positions[None], part.cache)[0])
        return (logits[0] if rows else None), logits[1:] if rows else logits

    def _decoded(self, logits: torch.Tensor) -> list[TokenOutput]:
        """Sample every running row's next token from its logits; retire the rows that finished."""
        outputs = [seq.accept(*picked) for seq, picked in zip(self._rows, self._sample(logits, self._rows))]
        finished = [row for row, out in enumerate(outputs) if out.finish_reason is not None]
        if finished:
            self._retire(finished)
        return outputs

    def _retire(self, rows: Sequence[int]) -> None:
        """Remove rows from the running batch and drop columns that became all padding."""
        gone = set(rows)
        keep = [row for row in range(len(self._rows)) if row not in gone]
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        self._cache, self._mask = _select_rows(self._cache, self._mask, keep)
        self._rows = [self._rows[row] for row in keep]

    def _forward(self, ids, mask, positions, cache) -> torch.Tensor:
        """One plain model call that appends to `cache`; returns float32 logits of the last column."""
        # The last column as an index, not logits_to_keep=1: a slice of a [1, n, hidden] prompt is a
        # strided view torch's matmul cannot fold to 2-D, so the LM head ran as a bmm over a copy of
        # its whole weight (vocab × hidden) on every prefill-only step; indexing gives a contiguous row.
        last = torch.tensor([ids.shape[1] - 1], device=ids.device)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=last,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        """Pick one token per row following that row's own sampling params."""
        params = [s.request.params for s in seqs]
        logprobs = logprobs_of(logits, params)  # of the model's own distribution, before any penalty
        for row, seq in enumerate(seqs):
            adjust_row(logits[row], seq)
        tokens = sample_tokens(logits, params, [s.generator for s in seqs])
        return [(token, lp(token) if lp else None) for token, lp in zip(tokens, logprobs)]


# ------------------------------------------------------------------------- helpers


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence axis (dim -2 for KV tensors, -1 for masks) on the left to `width`."""
    if x.dim() == 2:  # attention mask [rows, columns]
        missing = width - x.shape[1]
        return F.pad(x, (missing, 0)) if missing else x
    missing = width - x.shape[-2]
    return F.pad(x, (0, 0, missing, 0)) if missing else x


def _select_rows(cache: KVCache, mask: torch.Tensor, keep: list[int]):
    """Keep `keep` rows of cache and mask, then trim leading columns that are padding in all."""
    index = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    start = int(mask.any(dim=0).long().argmax())  # first column some row still uses
    mask = mask[:, start:]
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, start:, :]
        layer.values = layer.values.index_select(0, index)[:, :, start:, :]
    return cache, mask


def _max_positions(model) -> int | None:
    """The model's context length if its config states one (GPT-2's n_positions maps here)."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None) if config is not None else None
    return int(value) if isinstance(value, int) and value > 0 else None
