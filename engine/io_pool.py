"""A thread pool whose size can change while it runs (the io_threads knob).

concurrent.futures.ThreadPoolExecutor only grows; this one grows by starting threads and
shrinks by letting threads exit after their current task. Tokenization (HF fast tokenizers
release the GIL) and response shaping run here. Size 0 means no pool: work runs inline in
the caller's thread, which saves a thread hop per request when inputs are short.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

_RETIRE = object()


class IOPool:
    def __init__(self, size: int, name: str = "selftune-io"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._target = 0
        self._name = name
        self._closed = False
        self.resize(size)

    @property
    def size(self) -> int:
        return self._target

    def resize(self, size: int) -> None:
        if size < 0:
            raise ValueError("io_threads must be at least 0")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            for _ in range(size - self._target):
                thread = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
            for _ in range(self._target - size):
                self._tasks.put(_RETIRE)
            self._target = size

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError("the pool is shut down")
        future: Future = Future()
        if self._target == 0:
            _run_task(future, fn, args, kwargs)
        else:
            self._tasks.put((future, fn, args, kwargs))
        return future

    def shutdown(self) -> None:
        self._closed = True
        with self._lock:
            for _ in range(self._target):
                self._tasks.put(_RETIRE)
            self._target = 0
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is _RETIRE:
                return
            _run_task(*task)


def _run_task(future: Future, fn: Callable, args, kwargs) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:
        future.set_exception(exc)
