"""The generation cost model: seconds of one continuous-batching step of a worker, JSON.

A step is one forward pass, as in engine/generation.py (engine/ragged.py): the prefill of what joins
(prompt tokens) beside one decode token for every running row. Each part's cost is fitted from
steps that ran it alone; a step with both pays the fixed part of a call (reading the weights) once:

    prefill(n)    = p0 + p1·n + p2·n²        n prompt tokens this step (0: no prefill)
    decode(r, c)  = d0 + d1·r + d2·r·c       r running rows, each attending over c columns (r = 0: none)
    step          = (prefill + decode − min(p0, d0) if both) / speedup(threads) × max(1, busy workers × threads / cores)

Each thread count profiled has its own coefficients (`by_threads`); another count takes the
nearest profiled one below it. A chunk of a long prompt is costed as a prefill of the chunk (its
attention over the earlier chunks is left out: small next to the MLPs at these lengths).
Fitted by non-negative least squares on steps the real runner timed (`profile_generation`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

FORMAT = "selftune-gen-costmodel/1"


@dataclass(frozen=True)
class GenCostModel:
    by_threads: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]
    """threads -> ((p0, p1, p2), (d0, d1, d2))."""
    max_positions: int = 2048
    """The model's context: a trace's prompt + output are clipped to it."""
    kv_values_per_token: int = 0
    """Keys and values one token holds over all layers (the KV ceiling from model.kv_cache_mib)."""
    model: str = ""
    machine: str = ""
    points: list = field(default_factory=list)
    """The measured steps: [threads, prefill tokens, rows, columns, seconds]."""
    dtype: str = "float32"
    """The dtype the model ran in while profiled (files from before it was recorded were fp32)."""
    choice: dict = field(default_factory=dict)
    """How that dtype was chosen (model.dtype auto: the zygote's choice and its reason)."""

    def coefficients(self, threads: int):
        known = sorted(self.by_threads)
        below = [t for t in known if t <= threads]
        return self.by_threads[below[-1] if below else known[0]]

    def step_seconds(self, prefill_tokens: int, rows: int, columns: int, threads: int, busy: int = 1, cores: int = 1) -> float:
        (p0, p1, p2), (d0, d1, d2) = self.coefficients(threads)
        seconds = 0.0
        if prefill_tokens:
            seconds += p0 + p1 * prefill_tokens + p2 * prefill_tokens * prefill_tokens
        if rows:
            seconds += d0 + d1 * rows + d2 * rows * columns
        if prefill_tokens and rows:
            seconds -= min(p0, d0)  # both parts go through one model call, which reads the weights once
        return seconds * max(1.0, busy * threads / max(cores, 1))  # oversubscribed cores share out

    @property
    def backend(self) -> dict:
        """What costmodel.check_dtype reads: the dtype measured and the model.dtype that chose it."""
        return {"dtype": self.dtype, "requested": self.choice.get("requested")}

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "model": self.model, "machine": self.machine, "max_positions": self.max_positions,
            "kv_values_per_token": self.kv_values_per_token, "dtype": self.dtype, "choice": self.choice,
            "by_threads": {str(t): {"prefill": list(p), "decode": list(d)} for t, (p, d) in sorted(self.by_threads.items())},
            "points": self.points,
        }

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)


def load_gen_cost_model(path: str) -> GenCostModel:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a generation cost model (format {data.get('format')!r}, expected {FORMAT}); `selftune profile --task generate` writes one")
    by_threads = {int(t): (tuple(c["prefill"]), tuple(c["decode"])) for t, c in data["by_threads"].items()}
    return GenCostModel(by_threads, data.get("max_positions", 2048), data.get("kv_values_per_token", 0), data.get("model", ""), data.get("machine", ""),
                        data.get("points", []), data.get("dtype", "float32"), data.get("choice", {}))


def fit(points: list) -> dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]:
    """Per thread count: prefill coefficients from the prefill-only steps, decode ones from the
    decode-only steps (non-negative least squares, relative error: short steps weigh as much)."""
    from scipy.optimize import nnls

    data = np.asarray(points, float)
    out = {}
    for threads in sorted(set(data[:, 0].astype(int))):
        mine = data[data[:, 0] == threads]
        pre = mine[(mine[:, 1] > 0) & (mine[:, 2] == 0)]
        dec = mine[(mine[:, 1] == 0) & (mine[:, 2] > 0)]
        n, r, c = pre[:, 1], dec[:, 2], dec[:, 3]
        p, _ = nnls(np.column_stack([np.ones_like(n), n, n * n]) / pre[:, 4:5], np.ones(len(pre)))
        d, _ = nnls(np.column_stack([np.ones_like(r), r, r * c]) / dec[:, 4:5], np.ones(len(dec)))
        out[int(threads)] = (tuple(float(x) for x in p), tuple(float(x) for x in d))
    return out


def auto_batch_tokens(cost: GenCostModel) -> dict:
    """`max_batch_tokens: auto` as a live server on the profiled machine starts it: engine.gen_chunk's
    decision on the steps its probe times (a decode step of PROBE_ROWS short rows, and one with a
    PROBE_CHUNK-token chunk beside them, one thread), read off this cost model instead of timed."""
    from engine.config import CPU_BATCH_TOKENS_PER_THREAD
    from engine.gen_chunk import PROBE_CHUNK, PROBE_ROWS, decide_batch_tokens

    columns = 72  # the probe's rows: 64-token prompts and a few tokens made
    probe = {"rows": PROBE_ROWS, "chunk": PROBE_CHUNK, "decode_ms": 1000 * cost.step_seconds(0, PROBE_ROWS, columns, 1),
             "chunk_step_ms": 1000 * cost.step_seconds(PROBE_CHUNK, PROBE_ROWS, columns, 1)}
    return decide_batch_tokens(probe, CPU_BATCH_TOKENS_PER_THREAD)
