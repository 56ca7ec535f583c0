"""Embeddings through ONNX Runtime: the model exported once to ONNX and run by ORT's CPU
execution provider, with engine.embedding's pooling (mean over the mask, L2 norm).

`model.backend: auto` measures this against torch at start-up (engine.zygote) and keeps it
only where it is faster and holds the fidelity bar; `onnxruntime` forces it. The export is
cached under the cache directory like the GGUF conversion (engine.model_source), keyed on
the model's files and the torch version, so it runs once per model and machine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("selftune.worker")

EXPORT_VERSION = 1
"""Part of the cache key: bump it when the exported graph's inputs or outputs change."""

INSTALL_HINT = "pip install 'selftune[onnx]'"


def available() -> tuple[bool, str]:
    """(onnxruntime importable, its version or why not)."""
    try:
        import onnxruntime
    except ImportError as exc:
        return False, f"onnxruntime is not installed ({INSTALL_HINT}): {exc}"
    return True, onnxruntime.__version__


def served_name(choice: dict) -> str:
    """What a dtype choice serves, as the bench and profiler name it: `onnxruntime` (fp32), or
    the torch dtype (`float32`, `bfloat16`: mixed)."""
    return "onnxruntime" if choice.get("backend") == "onnxruntime" else str(choice.get("dtype") or "")


def export_path(model_path: str, cache_dir: str) -> str:
    """Where the export of the model in `model_path` lives: keyed on its files' names, sizes and
    mtimes, the torch version and EXPORT_VERSION, so a changed model or torch exports anew."""
    import torch

    key = hashlib.sha256(f"{EXPORT_VERSION} {torch.__version__}".encode())
    for name in sorted(os.listdir(model_path)):
        st = os.stat(os.path.join(model_path, name))
        key.update(f"{name} {st.st_size} {int(st.st_mtime)}".encode())
    name = os.path.basename(os.path.normpath(model_path))
    return os.path.join(os.path.abspath(cache_dir), "onnx", f"{name}-{key.hexdigest()[:16]}", "model.onnx")


def export(model, path: str) -> str:
    """Export `model` (a transformers encoder, fp32) to `path` once; an existing file is kept.
    Written to a temporary name first and renamed, so a server starting beside this one never
    reads half a file. Runs torch ops (tracing): call it where a forward may run, never in the zygote."""
    if os.path.exists(path):
        return path
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".onnx.tmp")
    os.close(fd)
    example = (torch.ones(2, 9, dtype=torch.long), torch.ones(2, 9, dtype=torch.long))
    axes = {0: "batch", 1: "length"}
    try:
        # The TorchScript exporter: its graph ran 5-10 % faster in ORT here than the dynamo
        # exporter's, exports in 2 s instead of 8, and needs no onnxscript.
        with warnings.catch_warnings():  # the exporter's notes on how it wrote indexing ops: not the user's concern
            warnings.simplefilter("ignore")
            torch.onnx.export(LastHidden(model).eval(), example, tmp, dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                              dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@dataclass(frozen=True, slots=True)
class OnnxGraph:
    """What the zygote hands a worker instead of the torch model when it serves ONNX Runtime:
    a path (each worker opens its own session after the fork; ORT's thread pools would not
    survive one)."""

    path: str
    hidden_size: int


class OnnxEmbeddingRunner:
    """engine.embedding.EmbeddingRunner's interface (`run`, `set_threads`) over an ORT session.
    Batches run padded: the exported graph takes a 2-D mask, so packing is not offered."""

    def __init__(self, path: str, threads: int = 1):
        self.path = path
        self.threads = 0
        self.session = None
        self.pack_row_tokens = 0
        self.set_threads(threads)

    def set_threads(self, threads: int) -> None:
        """ORT fixes a session's thread pool when it is made, so a new thread count opens a new
        session (~0.15 s for MiniLM); the same count changes nothing."""
        if threads == self.threads and self.session is not None:
            return
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3  # warnings about shape inference on dynamic axes are noise here
        self.session = ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])
        if self.threads:
            log.info("ONNX Runtime session reopened with %d threads (was %d)", threads, self.threads)
        self.threads = threads
        self.hidden_size = int(self.session.get_outputs()[0].shape[-1])

    def run(self, ids: np.ndarray, lengths: tuple[int, ...], out: np.ndarray) -> None:
        """Embed a padded (rows, length) int32 id matrix into `out` (rows, hidden), in place."""
        mask = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
        hidden = self.session.run(None, {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)})[0]
        weights = mask[..., None].astype(np.float32)
        vectors = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        out[:] = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
