"""The embedding forward pass: batched, mean-pooled over the attention mask, L2-normalised.

This is what sentence-transformers computes for all-MiniLM-L6-v2 (Transformer -> mean Pooling
-> Normalize); the tests hold it to that within 1e-4. Batches of mixed lengths run packed
(engine.packing): inputs end to end in rows, each attending only to itself through a
block-diagonal mask, with positions restarting at every input.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from engine import packing

log = logging.getLogger("selftune.engine")


class EmbeddingRunner:
    def __init__(self, model, device: str, pack_row_tokens: int = 0, vocab_size: int = 1000):
        self.model = model
        self.device = device
        self.pack_row_tokens = pack_row_tokens
        """Tokens per packed row; 0 runs every batch padded."""
        self.vocab_size = vocab_size
        self._checked = False

    @torch.inference_mode()
    def run(self, ids: np.ndarray, lengths: tuple[int, ...], out: np.ndarray) -> None:
        """Embed a padded (rows, length) int32 id matrix into `out` (rows, hidden), in place."""
        plan = packing.plan(lengths, self.pack_row_tokens)
        if plan is not None and not self._checked and not self.check_packing():
            plan = None
        vectors = self._padded(ids, lengths) if plan is None else self._packed(ids, lengths, plan)
        torch.from_numpy(out).copy_(F.normalize(vectors.float(), p=2, dim=1).cpu())

    def _padded(self, ids: np.ndarray, lengths: tuple[int, ...]) -> torch.Tensor:
        input_ids = torch.from_numpy(ids).to(self.device, torch.long)
        lengths_t = torch.tensor(lengths, device=self.device)
        mask = torch.arange(ids.shape[1], device=self.device)[None, :] < lengths_t[:, None]
        hidden = self.model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)

    def _packed(self, ids: np.ndarray, lengths: tuple[int, ...], plan: packing.Packing) -> torch.Tensor:
        rows, width = len(plan.rows), plan.row_length
        packed = np.zeros((rows, width), dtype=np.int64)
        positions = np.zeros((rows, width), dtype=np.int64)
        segment = np.full((rows, width), -1, dtype=np.int64)
        for r, members in enumerate(plan.rows):
            at = 0
            for index in members:
                n = lengths[index]
                packed[r, at : at + n] = ids[index, :n]
                positions[r, at : at + n] = np.arange(n)
                segment[r, at : at + n] = index
                at += n
        seg = torch.from_numpy(segment).to(self.device)
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        same |= torch.eye(width, dtype=torch.bool, device=self.device)  # padding attends to itself: no empty rows
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(rows, 1, width, width, dtype=dtype, device=self.device)
        mask.masked_fill_(~same[:, None], torch.finfo(dtype).min)
        hidden = self.model(
            input_ids=torch.from_numpy(packed).to(self.device),
            attention_mask=mask,
            position_ids=torch.from_numpy(positions).to(self.device),
        ).last_hidden_state
        flat = seg.reshape(-1)
        real = flat >= 0
        sums = torch.zeros(len(lengths), hidden.shape[-1], dtype=hidden.dtype, device=self.device)
        sums.index_add_(0, flat[real], hidden.reshape(-1, hidden.shape[-1])[real])
        return sums / torch.tensor(lengths, dtype=hidden.dtype, device=self.device)[:, None]

    def check_packing(self) -> bool:
        """Packed and padded agree on a mixed batch; if not (a model whose forward ignores a
        4-D mask or position ids), packing is switched off for this runner and False returned.
        `run` asks once, before its first packed batch (not at start-up: the first packed
        forward of a process is slow, and a worker that never packs should not pay for it)."""
        self._checked = True
        if not self.pack_row_tokens:
            return False
        vocab_size = self.vocab_size
        tolerance = 1e-4 if next(self.model.parameters()).dtype == torch.float32 else 3e-2
        lengths = (7, 3, 5, 2)
        rng = np.random.default_rng(0)
        ids = np.zeros((len(lengths), max(lengths)), dtype=np.int32)
        for row, n in enumerate(lengths):
            ids[row, :n] = rng.integers(100, min(vocab_size, 1000), n)
        try:
            with torch.inference_mode():
                padded = F.normalize(self._padded(ids, lengths).float(), dim=1).cpu().numpy()
                plan = packing.Packing(((0, 1), (2, 3)), 10)
                packed = F.normalize(self._packed(ids, lengths, plan).float(), dim=1).cpu().numpy()
            agree = bool(np.abs(packed - padded).max() <= tolerance)
            if not agree:
                log.warning("packing off: packed and padded embeddings differ for this model")
        except Exception as exc:  # a probe: whatever the model's forward raises, packing is off, the worker lives
            log.warning("packing off: the model's forward rejects a packed batch (%s)", exc)
            agree = False
        if not agree:
            self.pack_row_tokens = 0
        return agree
