"""A real `selftune serve` in a subprocess: started on a free loopback port, waited for, stopped.

Start-up failures are spotted early from the server's log (a crash loop, a dead zygote, an
engine that could not start) instead of waiting for the whole budget.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from gpucheck.common import Fail, free_port, http, say

FATAL_MARKERS = (
    "crash loop",
    "the zygote process died",
    "could not start the engine",
    "Cannot re-initialize CUDA in forked subprocess",
)
NOTABLE_MARKERS = ("WARNING", "ERROR", "Traceback", "packing off", "CUDA error")


def selftune_command() -> list[str]:
    """The `selftune` console script of this interpreter's environment, else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "selftune")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("selftune")
    if found:
        return [found]
    raise Fail("the `selftune` command is not installed in this environment: run "
               "scripts/gpu_check.sh --install (or --offline-wheelhouse DIR) first")


class ServeProcess:
    """`selftune serve --config FILE --port P`, its log in `log_path`."""

    def __init__(self, config_path: str, log_path: str, env: dict | None = None):
        self.config_path = config_path
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_seconds: float | None = None
        self.first_failure: dict | None = None
        """Set by the caller when this server is a second attempt: the first one's error."""

    def start(self, timeout: float) -> "ServeProcess":
        command = selftune_command() + ["serve", "--config", self.config_path, "--port", str(self.port)]
        self.started_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop(grace=5)
            raise
        self.ready_seconds = round(time.monotonic() - self.started_at, 1)
        say(f"  server {os.path.basename(self.config_path)} ready on :{self.port} after {self.ready_seconds} s")
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = self.started_at + timeout
        next_note = self.started_at + 10
        while True:
            if self.proc.poll() is not None:
                raise Fail(f"selftune serve exited with {self.proc.returncode} before it was ready",
                           {"log_tail": self.log_tail()})
            fatal = self._fatal_line()
            if fatal:
                raise Fail(f"selftune serve failed while starting: {fatal}", {"log_tail": self.log_tail()})
            try:
                status, body, _ = http("GET", self.url + "/readyz", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            now = time.monotonic()
            if now > deadline:
                raise Fail(f"selftune serve not ready within {timeout:.0f} s", {"log_tail": self.log_tail()})
            if now > next_note:
                say(f"  ... waiting for the server ({now - self.started_at:.0f} s)")
                next_note = now + 10
            time.sleep(0.25)

    def _fatal_line(self) -> str | None:
        for line in self.log_lines():
            if any(marker in line for marker in FATAL_MARKERS):
                return line.strip()
        return None

    def log_lines(self) -> list[str]:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read().splitlines()
        except OSError:
            return []

    def log_tail(self, lines: int = 40) -> list[str]:
        return self.log_lines()[-lines:]

    def notable_log_lines(self, limit: int = 20) -> list[str]:
        """Warnings, errors and tracebacks the server logged (what a reviewer should read)."""
        found = [line.strip() for line in self.log_lines() if any(m in line for m in NOTABLE_MARKERS)]
        return found[:limit]

    def banner(self) -> list[str]:
        """The start-up lines `selftune:` prints (device, dtype, knobs, placement)."""
        return [line.strip() for line in self.log_lines() if line.startswith("selftune:")]

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM, wait up to `grace` s, then SIGKILL the whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return self.proc.wait(timeout=10)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
