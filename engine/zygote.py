"""The zygote: a process that imports torch, loads the weights once, and forks workers.

Workers forked from it share its pages (the imports and the weights, ~240 MB + the model)
instead of paying for their own copies: a forked CPU worker costs ~20 MB of its own. The
zygote is started with exec (not forked from the front process, whose threads would make a
fork unsafe), stays single-threaded, and never runs a torch op: OpenMP thread pools do not
survive fork, so each worker starts its own after it is forked.

Run as `python -m engine.zygote FD MODEL_PATH TASK DEVICE DTYPE`; FD is its socket to the front.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from engine import messages as m
from engine.heap import freeze_startup_heap

log = logging.getLogger("selftune.zygote")


def main(argv: list[str]) -> int:
    fd, model_path, task, device, dtype = int(argv[0]), argv[1], argv[2], argv[3], argv[4]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    # Ctrl-C and SIGTERM often reach the whole process group (a terminal, `timeout`, systemd):
    # shutting down is the front process's job; the zygote and workers follow it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited workers
    conn = Connection(fd)
    try:
        model, device, dtype_name = _load(model_path, task, device, dtype)
    except Exception:
        conn.send(m.ZygoteFailed(traceback.format_exc()))
        return 1
    freeze_startup_heap()
    conn.send(m.ZygoteLoaded(device, dtype_name))
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


def _load(model_path: str, task: str, device: str, dtype: str):
    import torch

    from engine.loading import load_model, resolve_device, resolve_dtype
    from engine.worker import die_with_parent

    die_with_parent()
    torch.set_num_threads(1)
    _no_background_threads()
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    model = load_model(model_path, task, torch_dtype)
    if threading.active_count() > 1:  # idle native pools (torch, OpenBLAS) are fork-safe; Python threads are not
        names = [t.name for t in threading.enumerate()]
        log.warning("zygote has Python threads %s after loading; forking may be unsafe", names)
    return model, device, str(torch_dtype).removeprefix("torch.")


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
