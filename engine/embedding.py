"""The embedding forward pass: batched, mean-pooled over the attention mask, L2-normalised.

This is what sentence-transformers computes for all-MiniLM-L6-v2 (Transformer -> mean Pooling
-> Normalize); the tests hold it to that within 1e-4. Batches of mixed lengths run packed
(engine.packing): inputs end to end in rows, each attending only to itself through a
block-diagonal mask, with positions restarting at every input.

A model whose Linear weights are in bf16 and the rest in fp32 (engine.loading's mixed
precision) runs under autocast; pooling and normalisation always run in fp32. `probe_dtype`
is what `model.dtype: auto` decides with: fidelity against fp32 on a fixed probe set, and
the speed of both, interleaved.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from engine import packing
from engine.loading import MIN_COSINE, MIN_SPEEDUP, compute_dtype, decided_before_probe

log = logging.getLogger("selftune.engine")


class EmbeddingRunner:
    def __init__(self, model, device: str, pack_row_tokens: int = 0, vocab_size: int = 1000):
        self.model = model
        self.device = device
        self.pack_row_tokens = pack_row_tokens
        """Tokens per packed row; 0 runs every batch padded."""
        self.vocab_size = vocab_size
        self._checked = False
        self.compute_dtype = compute_dtype(model)
        """The matmuls' dtype (the Linear weights')."""
        self.activation_dtype = next(model.parameters()).dtype
        """The residual stream's dtype (the embeddings')."""
        self._autocast = self.compute_dtype != self.activation_dtype
        self._device_type = torch.device(device).type
        self.hidden_size = int(getattr(getattr(model, "config", None), "hidden_size", 0)) or int(next(model.parameters()).shape[-1])

    def set_threads(self, threads: int) -> None:
        """torch's intra-op pool is the process's: one size for every runner in it."""
        torch.set_num_threads(threads)

    def _forward(self, **inputs) -> torch.Tensor:
        """The model's last hidden state, in fp32 for pooling; mixed precision under autocast."""
        context = torch.autocast(self._device_type, dtype=self.compute_dtype) if self._autocast else contextlib.nullcontext()
        with context:
            hidden = self.model(**inputs).last_hidden_state
        return hidden.float()

    @torch.inference_mode()
    def run(self, ids: np.ndarray, lengths: tuple[int, ...], out: np.ndarray) -> None:
        """Embed a padded (rows, length) int32 id matrix into `out` (rows, hidden), in place."""
        plan = packing.plan(lengths, self.pack_row_tokens)
        if plan is not None and not self._checked and not self.check_packing():
            plan = None
        vectors = self._padded(ids, lengths) if plan is None else self._packed(ids, lengths, plan)
        torch.from_numpy(out).copy_(F.normalize(vectors, p=2, dim=1).cpu())

    def _padded(self, ids: np.ndarray, lengths: tuple[int, ...]) -> torch.Tensor:
        input_ids = torch.from_numpy(ids).to(self.device, torch.long)
        lengths_t = torch.tensor(lengths, device=self.device)
        mask = torch.arange(ids.shape[1], device=self.device)[None, :] < lengths_t[:, None]
        hidden = self._forward(input_ids=input_ids, attention_mask=mask.long())
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
        dtype = self.activation_dtype
        mask = torch.zeros(rows, 1, width, width, dtype=dtype, device=self.device)
        mask.masked_fill_(~same[:, None], torch.finfo(dtype).min)
        hidden = self._forward(
            input_ids=torch.from_numpy(packed).to(self.device),
            attention_mask=mask,
            position_ids=torch.from_numpy(positions).to(self.device),
        )
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
        tolerance = 1e-4 if self.compute_dtype == torch.float32 else 3e-2
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


def load_served_runner(model_path: str, served: str, pack_row_tokens: int = packing.DEFAULT_ROW_TOKENS, threads: int = 1):
    """A runner for what the server serves (`served`: engine.onnx_embedding.served_name of its
    choice), loaded as the zygote loads it, for the bench's limit and the profiler to measure:
    torch `float32` or `bfloat16` (mixed), or `onnxruntime` on the cached export (the choice made it)."""
    from engine.config import default_cache_dir
    from engine.loading import load_model, resolve_dtype

    if served == "onnxruntime":
        from engine.onnx_embedding import OnnxEmbeddingRunner, export_path

        return OnnxEmbeddingRunner(export_path(model_path, default_cache_dir()), threads)
    torch.set_num_threads(threads)
    model = load_model(model_path, "embed", resolve_dtype(served, "cpu"))
    return EmbeddingRunner(model, "cpu", pack_row_tokens, int(getattr(model.config, "vocab_size", 0) or 1000))


PROBE_TEXTS = (
    "hello world",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog.",
    "selftune tunes its own concurrency while it serves embeddings and text generation.",
    "How do I reset my password if I no longer have access to the email address on my account?",
    "Order #48213 shipped on 2024-03-07 and should arrive within 3 to 5 business days.",
    "def add(a, b): return a + b  # adds two numbers",
    "Ein kleines Haus am Fluss, weit weg von der Stadt.",
    "La tour Eiffel a été construite pour l'Exposition universelle de 1889.",
    "Batching stops paying at about sixteen short inputs on two cores, and packing helps mixed lengths.",
    "Embeddings map sentences to vectors; similar sentences land close together, unrelated ones far apart.",
    "The first train leaves the old city early, crosses the long bridge over the river, and reaches "
    "the small village near the forest before the market opens.",
    "Mean pooling averages the token vectors of a sentence, weighted by the attention mask, and the "
    "result is normalised to unit length so that a dot product between two of them is their cosine.",
    "A model-inference server that tunes its own concurrency while it serves: worker processes, threads "
    "per worker, pre- and post-processing threads, batch timeout and maximum batch size change live "
    "without losing a request, driven by a policy that reads latency, throughput and the machine's load.",
    "ok",
)
"""The fixed probe set of `model.dtype: auto`: short and long, prose, numbers, code, German and
French. Every one must keep MIN_COSINE against fp32."""


def _batch(ids: list[list[int]]) -> tuple[np.ndarray, tuple[int, ...]]:
    lengths = tuple(len(x) for x in ids)
    matrix = np.zeros((len(ids), max(lengths)), dtype=np.int32)
    for row, x in enumerate(ids):
        matrix[row, : len(x)] = x
    return matrix, lengths


def probe_dtype(model, device: str, candidate, ids: list[list[int]], rounds: int = 3, timing: bool = True,
                pack_row_tokens: int = packing.DEFAULT_ROW_TOKENS, vocab_size: int = 1000, others: dict | None = None) -> dict:
    """The fp32 `model` against a mixed-precision copy of it in `candidate` (torch.bfloat16; None:
    no copy), and against `others` (name -> a runner of another backend, e.g. ONNX Runtime).

    Fidelity: each probe input's embedding from the candidate, in the packed and the padded
    batch (from another backend, as it serves), against fp32's padded batch (which equals each
    input alone); the worst cosine. Speed (`timing`): the probe batch in each, in turns whose
    order rotates (engine.embedding.interleaved). Leaves `model` as it was; the copy costs one
    model's memory while it lives. `others`' results are under "others": {name: {min_cosine,
    ms, speedup}}."""
    import copy

    from engine.loading import to_mixed_precision

    started = time.perf_counter()
    reference = model if device == "cpu" else copy.deepcopy(model).to(device)
    matrix, lengths = _batch(ids)
    expected = EmbeddingRunner(reference, device, 0, vocab_size)

    def embed(runner) -> np.ndarray:
        out = np.empty((len(lengths), expected.hidden_size), dtype=np.float32)
        runner.run(matrix, lengths, out)
        return out

    want = embed(expected)
    runners = {"float32": EmbeddingRunner(reference, device, pack_row_tokens, vocab_size)}
    result: dict = {"probe_inputs": len(lengths), "others": {}}
    if candidate is not None:
        trial = to_mixed_precision(copy.deepcopy(model), candidate).to(device)
        runners["candidate"] = EmbeddingRunner(trial, device, pack_row_tokens, vocab_size)
        cos_packed = (embed(runners["candidate"]) * want).sum(axis=1)
        cos_padded = (embed(EmbeddingRunner(trial, device, 0, vocab_size)) * want).sum(axis=1)
        result.update(candidate=str(candidate).removeprefix("torch."), min_cosine=float(min(cos_packed.min(), cos_padded.min())),
                      min_cosine_packed=float(cos_packed.min()), min_cosine_padded=float(cos_padded.min()),
                      worst_input=int(np.argmin(np.minimum(cos_packed, cos_padded))))
    for name, runner in (others or {}).items():
        runners[name] = runner
        result["others"][name] = {"min_cosine": float((embed(runner) * want).sum(axis=1).min())}
    if timing:
        times = interleaved(runners, embed, rounds, warm=set(runners) - {"float32"})
        result["float32_ms"] = times["float32"]
        if candidate is not None:
            result["candidate_ms"] = times["candidate"]
            result["speedup"] = min(times["float32"]) / min(times["candidate"])
        for name in others or {}:
            result["others"][name].update(ms=times[name], speedup=min(times["float32"]) / min(times[name]))
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def interleaved(runners: dict, embed, rounds: int, warm: set = frozenset()) -> dict[str, list[float]]:
    """Milliseconds per call of `embed(runner)` for each runner: one warm-up each not in `warm`
    (the first forward at a shape pays for it; the fidelity check has run the others), then
    `rounds` rounds whose order rotates (A B C, B C A, ...) so each shares the machine's good
    and bad spells; the fastest counts (noise only adds)."""
    order = list(runners)
    for name in order:
        if name not in warm:
            embed(runners[name])
    times: dict[str, list[float]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            t = time.perf_counter()
            embed(runners[name])
            times[name].append(round((time.perf_counter() - t) * 1e3, 2))
    return times


def decide_dtype(requested: str, native: tuple[bool, str] | None, probe: dict | None, error: str | None = None) -> dict:
    """`model.dtype: auto`'s choice, from the native-bf16 check and the probe (pure).

    bfloat16 only when (a) the device has native bf16, (b) every probe input keeps
    MIN_COSINE against fp32, (c) it measured at least MIN_SPEEDUP faster; float32 otherwise.
    A forced dtype is kept as asked, with whatever was measured of it. `min_cosine` is the
    served dtype's worst cosine against fp32 on the probe set (1.0 for fp32 itself; None when
    nothing was measured); `bf16_*` is what the probe measured of the candidate."""
    choice: dict = {"requested": requested}
    if native is not None:
        choice["native_bf16"], choice["native_bf16_reason"] = native
    if probe:
        choice["bf16_min_cosine"] = probe["min_cosine"]
        for key, name in (("speedup", "bf16_speedup"), ("float32_ms", "float32_ms"), ("candidate_ms", "bf16_ms")):
            if key in probe:
                choice[name] = probe[key]
        choice["probe_inputs"] = probe.get("probe_inputs")
        choice["probe_seconds"] = probe.get("seconds")
    if error is not None:
        choice["probe_error"] = error
    settled = decided_before_probe(requested, native, probe, error)
    if settled is not None:
        dtype, reason = settled
    elif probe["min_cosine"] < MIN_COSINE:
        dtype, reason = "float32", f"bf16 cosine {probe['min_cosine']:.6f} < {MIN_COSINE} on the probe set"
    elif probe.get("speedup", 0.0) < MIN_SPEEDUP:
        dtype, reason = "float32", f"bf16 only {probe.get('speedup', 0.0):.2f}x fp32 on the probe batch (< {MIN_SPEEDUP}x)"
    else:
        dtype, reason = "bfloat16", f"native bf16, cosine {probe['min_cosine']:.6f} >= {MIN_COSINE}, {probe['speedup']:.2f}x fp32"
    choice["dtype"], choice["reason"] = dtype, reason
    if dtype == "bfloat16":
        choice["mode"] = "bf16-mixed"
        choice["precision"] = "Linear weights bf16 under autocast; embeddings, LayerNorm, residuals, pooling fp32"
        choice["min_cosine"] = probe["min_cosine"] if probe else None
    elif dtype == "float32":
        choice["mode"], choice["min_cosine"] = "fp32", 1.0
    else:
        choice["mode"], choice["min_cosine"] = "cast", None
    return choice


class BackendError(RuntimeError):
    """`model.backend: onnxruntime` was asked for and cannot be served here."""


def decide_backend(requested: str, choice: dict, probe: dict | None, error: str | None = None) -> dict:
    """`model.backend`'s choice on top of decide_dtype's `choice` (pure): torch as decided, or
    ONNX Runtime (fp32).

    auto takes ONNX Runtime only when model.dtype is auto too (a named dtype names a torch
    precision), every probe input kept MIN_COSINE, and its probe batch ran at least MIN_SPEEDUP
    faster than the torch choice's. `onnxruntime` is taken as asked; if it could not be exported
    or run (`error`), BackendError. What was measured of it is under `onnxruntime_*`."""
    choice = dict(choice)
    measured = (probe or {}).get("others", {}).get("onnxruntime")
    for key in ("min_cosine", "speedup", "ms"):
        if measured and key in measured:
            choice[f"onnxruntime_{key}"] = measured[key]
    if error is not None:
        choice["onnxruntime_error"] = error
    if requested == "onnxruntime":
        if error is not None or measured is None:
            raise BackendError(f"model.backend: onnxruntime cannot be served: {error or 'it was not probed'}")
        return _onnx_choice(choice, measured["min_cosine"], "forced by model.backend: onnxruntime")
    choice["backend"] = "torch"
    if requested == "torch" or choice["requested"] != "auto" or (measured is None and error is None):
        return choice
    torch_speedup = choice.get("bf16_speedup", 1.0) if choice["dtype"] == "bfloat16" else 1.0
    if error is not None:
        choice["reason"] += f"; onnxruntime not used ({error})"
    elif measured["min_cosine"] < MIN_COSINE:
        choice["reason"] += f"; onnxruntime cosine {measured['min_cosine']:.6f} < {MIN_COSINE}"
    elif "speedup" not in measured or measured["speedup"] / torch_speedup < MIN_SPEEDUP:
        choice["reason"] += f"; onnxruntime {measured.get('speedup', 0.0) / torch_speedup:.2f}x the torch choice (< {MIN_SPEEDUP}x)"
    else:
        ratio = measured["speedup"] / torch_speedup
        return _onnx_choice(choice, measured["min_cosine"],
                            f"onnxruntime fp32, cosine {measured['min_cosine']:.6f} >= {MIN_COSINE}, {ratio:.2f}x torch {choice['dtype']}")
    return choice


def _onnx_choice(choice: dict, min_cosine: float, reason: str) -> dict:
    return {**choice, "backend": "onnxruntime", "dtype": "float32", "mode": "onnxruntime-fp32", "min_cosine": min_cosine,
            "reason": reason, "precision": "ONNX Runtime CPU execution provider, fp32; pooling fp32"}
