"""The zygote: a process that imports torch, loads the weights once, and forks workers.

Workers forked from it share its pages (the imports and the weights, ~240 MB + the model)
instead of paying for their own copies: a forked CPU worker costs ~20 MB of its own. The
zygote is started with exec (not forked from the front process, whose threads would make a
fork unsafe), stays single-threaded, and never runs a torch op: OpenMP thread pools do not
survive fork, so each worker starts its own after it is forked.

An embedding model with `dtype: auto` (or bfloat16, or `backend` auto/onnxruntime) is probed
once after loading, in a child forked for the purpose (so the zygote itself still runs no
forward and never initialises CUDA): bf16's and ONNX Runtime's fidelity against fp32 on a fixed
probe set (the ONNX export made there once and cached) and, for auto, their speed.
engine.embedding.decide_dtype and decide_backend pick; the choice travels to the front in
`ZygoteLoaded` and is logged here. Serving ONNX Runtime, the zygote hands its workers the graph's
path (engine.onnx_embedding.OnnxGraph) instead of the torch model.

Run as `python -m engine.zygote FD MODEL_PATH TASK DEVICE DTYPE BACKEND CACHE_DIR`; FD is its
socket to the front.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from engine import messages as m
from engine.config import default_cache_dir
from engine.heap import freeze_startup_heap

log = logging.getLogger("selftune.zygote")

PROBE_TIMEOUT = 120.0
"""Seconds the dtype probe may take; past them it is killed and auto stays on fp32."""


def main(argv: list[str]) -> int:
    fd, model_path, task, device, dtype, backend, cache_dir, batch_tokens = int(argv[0]), *argv[1:8]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    # Ctrl-C and SIGTERM often reach the whole process group (a terminal, `timeout`, systemd):
    # shutting down is the front process's job; the zygote and workers follow it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited workers
    conn = Connection(fd)
    try:
        model, device, choice = load_for_serving(model_path, task, device, dtype, backend, cache_dir)
    except Exception:
        conn.send(m.ZygoteFailed(traceback.format_exc()))
        return 1
    # `max_batch_tokens: auto` on a CPU: the chunk a step can prefill, measured on the model as served
    chunk = _measure_batch_tokens(model, int(batch_tokens)) if batch_tokens != "fixed" and task == "generate" and device == "cpu" else None
    freeze_startup_heap()
    conn.send(m.ZygoteLoaded(device, choice["dtype"], choice, chunk))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return 0  # the front process is gone; workers follow through PR_SET_PDEATHSIG
        if isinstance(msg, m.Fork):
            _fork(conn, msg.spec, model)
        elif isinstance(msg, m.Stop):
            return 0
        else:
            log.error("zygote: refusing an unknown message %s", type(msg).__name__)


def load_for_serving(model_path: str, task: str, device: str, dtype: str, backend: str = "auto", cache_dir: str | None = None):
    """(model, device, dtype choice) as every worker gets them: also what the bench's limit and
    the profiler call, in a process of their own, so they measure the backend the server serves.
    `model` is an engine.onnx_embedding.OnnxGraph when the choice is ONNX Runtime."""
    import torch

    from engine.loading import load_model, resolve_device, resolve_dtype
    from engine.worker import die_with_parent

    die_with_parent()
    torch.set_num_threads(1)
    _no_background_threads()
    device = resolve_device(device)
    if task == "embed" and (dtype in ("auto", "bfloat16") or backend == "onnxruntime"):
        model, choice = _load_embedding(model_path, device, dtype, backend, cache_dir or default_cache_dir())
    elif task == "generate" and dtype == "auto" and device == "cpu":
        model, choice = _load_generation(model_path, device)
    else:
        torch_dtype = resolve_dtype(dtype, device)
        model = load_model(model_path, task, torch_dtype)
        name = str(torch_dtype).removeprefix("torch.")
        reason = f"forced by model.dtype: {dtype}" if dtype != "auto" else f"auto for {task} on {device}: not probed"
        choice = {"requested": dtype, "dtype": name, "mode": "fp32" if name == "float32" else "cast", "reason": reason,
                  "min_cosine": 1.0 if name == "float32" else None, "backend": "torch"}
    _wait_for_loader_threads()
    if threading.active_count() > 1:  # idle native pools (torch, OpenBLAS) are fork-safe; Python threads are not
        names = [t.name for t in threading.enumerate()]
        log.warning("zygote has Python threads %s after loading; forking may be unsafe", names)
    cosine, agreement = choice.get("min_cosine"), choice.get("bf16_token_agreement")
    fidelity = (f"bf16 picks fp32's next token (or a near tie) at {agreement:.2%} of the probe positions" if agreement is not None
                else "worst cosine to fp32 on the probe set " + ("n/a" if cosine is None else f"{cosine:.6f}"))
    log.info("model backend %s, dtype %s (model.backend: %s, model.dtype: %s; %s): %s; %s",
             choice["backend"], choice["dtype"], backend, dtype, choice["mode"], choice["reason"], fidelity)
    return model, device, choice


def _wait_for_loader_threads(timeout: float = 2.0) -> None:
    """transformers loads weights on a ThreadPoolExecutor it shuts down without waiting; its
    threads end a moment later. Give them that moment before anything forks."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def _load_embedding(model_path: str, device: str, dtype: str, backend: str, cache_dir: str):
    """fp32 weights; bf16's and ONNX Runtime's fidelity (and, for auto, speed) measured in a probe
    child; then the Linear weights converted here if bf16 it is (once, shared by every worker),
    or the torch model dropped for the ONNX graph's path if ONNX Runtime it is."""
    import torch

    from engine.embedding import decide_backend, decide_dtype
    from engine.loading import load_model, native_bf16, to_mixed_precision
    from engine.onnx_embedding import OnnxGraph, export_path

    model = load_model(model_path, "embed", torch.float32)
    _wait_for_loader_threads()
    native = None if device.startswith("cuda") else native_bf16(device)  # CUDA's check initialises CUDA: the child asks
    bf16 = dtype == "bfloat16" or (dtype == "auto" and backend != "onnxruntime" and (native is None or native[0]))
    onnx = backend == "onnxruntime" or (backend == "auto" and dtype == "auto")
    onnx_path = export_path(model_path, cache_dir) if onnx else None
    probe = error = onnx_error = None
    if bf16 or onnx:
        timing = dtype == "auto" and backend != "onnxruntime"
        result = _in_probe_child(lambda: _probe(model_path, model, device, timing, bf16, onnx_path))
        error, probe, onnx_error = result.get("error"), result.get("probe"), result.get("onnx_error")
        if "native" in result:
            native = tuple(result["native"])
    bf16_probe = probe if probe and "candidate" in probe else None
    choice = decide_backend(backend, decide_dtype(dtype, native, bf16_probe, error), probe, onnx_error or (error if onnx else None))
    if choice["backend"] == "onnxruntime":
        choice["onnx_path"] = onnx_path
        return OnnxGraph(onnx_path, int(model.config.hidden_size)), choice
    if choice["dtype"] == "bfloat16":
        to_mixed_precision(model, torch.bfloat16)
    return model, choice


def _load_generation(model_path: str, device: str):
    """`model.dtype: auto` for generation on a CPU: fp32 weights; with native bf16, bf16's next
    tokens and decode speed measured in a probe child (engine.gen_dtype); the whole model cast
    here if bf16 it is (once, shared by every worker)."""
    import torch

    from engine.gen_dtype import decide_generation_dtype
    from engine.loading import load_model, native_bf16

    model = load_model(model_path, "generate", torch.float32)
    _wait_for_loader_threads()
    native = native_bf16(device)
    result = _in_probe_child(lambda: _probe_generation(model_path, model)) if native[0] else {}
    choice = decide_generation_dtype("auto", native, result.get("probe"), result.get("error"))
    return (model.to(torch.bfloat16) if choice["dtype"] == "bfloat16" else model), choice


def _measure_batch_tokens(model, fallback: int) -> dict:
    """engine.gen_chunk's probe in a probe child, on one thread; its decision (the constant
    `fallback` per thread if the probe failed)."""
    from engine.gen_chunk import decide_batch_tokens, probe_batch_tokens

    def probe() -> dict:
        import torch

        from engine.worker import die_with_parent

        die_with_parent()
        torch.set_num_threads(1)  # as a worker with threads_per_process 1 runs
        return {"probe": probe_batch_tokens(model)}

    result = _in_probe_child(probe)
    choice = decide_batch_tokens(result.get("probe"), fallback, result.get("error"))
    log.info("max_batch_tokens auto: %d prompt tokens a step per worker thread (%s)", choice["per_thread"], choice["reason"])
    return choice


def _probe_generation(model_path: str, model) -> dict:
    """In the probe child: engine.gen_dtype's probe on the fixed probe texts, on one thread."""
    import torch

    from engine.embedding import PROBE_TEXTS
    from engine.gen_dtype import probe_generation_dtype
    from engine.loading import load_tokenizer, model_info, token_ids
    from engine.worker import die_with_parent

    die_with_parent()
    torch.set_num_threads(1)  # as a worker with threads_per_process 1 runs
    tokenizer = load_tokenizer(model_path)
    ids = [x for x in token_ids(tokenizer, list(PROBE_TEXTS)) if x]
    return {"probe": probe_generation_dtype(model, ids, model_info(model_path, tokenizer).eos_token_ids)}


def _in_probe_child(probe) -> dict:
    """`probe()` in a forked child; its answer (a JSON-able dict) here ({"error": ...} if it
    failed or timed out). The child runs the forwards, so the zygote stays a process that never
    ran one (OpenMP pools, CUDA contexts) and every worker it forks starts clean."""
    started = time.monotonic()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            try:
                answer = probe()
            except BaseException as exc:  # whatever the probe raises, auto falls back to fp32
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            data = json.dumps(answer).encode()
            while data:
                data = data[os.write(write_end, data) :]
        finally:
            os._exit(0)
    os.close(write_end)
    chunks: list[bytes] = []
    try:
        while True:
            left = PROBE_TIMEOUT - (time.monotonic() - started)
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return {"error": f"the probe took over {PROBE_TIMEOUT:.0f}s"}
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _reap(pid)
    try:
        return json.loads(b"".join(chunks)) if chunks else {"error": "the probe child died without an answer"}
    except ValueError:
        return {"error": "the probe child's answer was cut short"}


def _reap(pid: int) -> None:
    """Wait for the probe child (it has answered or been killed). In the zygote, where SIGCHLD is
    ignored, the kernel reaps it and waitpid only says so (ECHILD)."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _probe(model_path: str, model, device: str, timing: bool, bf16: bool, onnx_path: str | None) -> dict:
    """In the probe child: the native check (CUDA), the ONNX export (once: cached) and an ORT
    runner for it, then the probe on the fixed probe set."""
    import torch

    from engine.embedding import PROBE_TEXTS, probe_dtype
    from engine.loading import load_tokenizer, native_bf16, token_ids
    from engine.worker import die_with_parent

    die_with_parent()
    torch.set_num_threads(1)  # as a worker with threads_per_process 1 runs
    answer: dict = {}
    if device.startswith("cuda") and bf16:
        answer["native"] = native_bf16(device)
        bf16 = answer["native"][0]
    others = {}
    if onnx_path is not None:
        try:
            others["onnxruntime"] = _onnx_runner(model, device, onnx_path)
        except Exception as exc:  # a model ORT cannot take: torch serves (auto) or start-up fails (forced)
            answer["onnx_error"] = f"{type(exc).__name__}: {exc}"
    if not bf16 and not others:
        return answer
    ids = token_ids(load_tokenizer(model_path), list(PROBE_TEXTS))
    vocab = int(getattr(model.config, "vocab_size", 0) or 1000)
    answer["probe"] = probe_dtype(model, device, torch.bfloat16 if bf16 else None, ids, timing=timing, vocab_size=vocab, others=others)
    return answer


def _onnx_runner(model, device: str, onnx_path: str):
    from engine.onnx_embedding import OnnxEmbeddingRunner, available, export

    if device != "cpu":
        raise RuntimeError(f"selftune runs ONNX Runtime on CPU only, and the device is {device}")
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    started = time.perf_counter()
    fresh = not os.path.exists(onnx_path)
    export(model, onnx_path)
    if fresh:
        log.info("exported the model to ONNX at %s in %.1f s", onnx_path, time.perf_counter() - started)
    return OnnxEmbeddingRunner(onnx_path, threads=1)


def _no_background_threads() -> None:
    """Progress bars start a tqdm monitor thread; a forked child would inherit its locks."""
    import tqdm
    from transformers.utils import logging as hf_logging

    tqdm.tqdm.monitor_interval = 0
    hf_logging.disable_progress_bar()


def _fork(conn: Connection, spec: m.WorkerSpec, model) -> None:
    front_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        front_end.close()
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        code = 1
        try:
            from engine.worker import run_worker

            code = run_worker(spec, Connection(worker_end.detach()), model)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    worker_end.close()
    conn.send(m.Forked(spec.worker_id, pid))
    send_handle(conn, front_end.fileno(), pid)
    front_end.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
