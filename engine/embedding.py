"""The embedding forward pass: batched, mean-pooled over the attention mask, L2-normalised.

This is what sentence-transformers computes for all-MiniLM-L6-v2 (Transformer -> mean Pooling
-> Normalize); the tests hold it to that within 1e-4.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class EmbeddingRunner:
    def __init__(self, model, device: str):
        self.model = model
        self.device = device

    @torch.inference_mode()
    def run(self, ids: np.ndarray, lengths: tuple[int, ...], out: np.ndarray) -> None:
        """Embed a padded (rows, length) int32 id matrix into `out` (rows, hidden), in place."""
        input_ids = torch.from_numpy(ids).to(self.device, torch.long)
        lengths_t = torch.tensor(lengths, device=self.device)
        mask = torch.arange(ids.shape[1], device=self.device)[None, :] < lengths_t[:, None]
        hidden = self.model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        vectors = F.normalize(pooled.float(), p=2, dim=1)
        torch.from_numpy(out).copy_(vectors.cpu())
