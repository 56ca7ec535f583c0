"""Start `selftune serve` as a real process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp_path: Path | str, config: dict, env: dict | None = None, ready_timeout: float = 180.0):
        tmp_path = Path(tmp_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp_path / f"config-{self.port}.yaml"
        config = {**config, "server": {**config.get("server", {}), "port": self.port}}
        path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self._cpu_seen: dict[tuple[int, float], float] = {}
        """CPU seconds last seen per process (pid, start time): `cpu_seconds` keeps the exited ones."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.cli", "serve", "--config", str(path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def processes(self) -> list[psutil.Process]:
        """The front process and every process under it (zygote, workers)."""
        front = psutil.Process(self.proc.pid)
        return [front, *front.children(recursive=True)]

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every process of the server so far, those that have exited
        included: a worker the controller retired keeps the CPU it was last seen to have used (else
        the total would drop when one goes, and a step's CPU read negative)."""
        for p in self.processes():
            used = cpu_seconds([p])
            if used:
                self._cpu_seen[(p.pid, p.create_time())] = used  # psutil keeps create_time from when it found the process
        return sum(self._cpu_seen.values())

    def memory_bytes(self) -> int:
        """Proportional set size summed over the server's processes: shared pages counted once."""
        total = 0
        for p in self.processes():
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        return total

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def stop_session(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 90.0) -> int:
    """Stop a server started in a session of its own (`start_new_session=True`): `sig` to it, and
    past `timeout` SIGKILL to its whole process group (its workers, Ray's processes, a peer's
    children); its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """CPU time (user + system) of these processes so far; one that is gone counts nothing."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total
