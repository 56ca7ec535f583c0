"""Small helpers shared by tests (no fixtures here)."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """True if pid runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Poll `predicate` until it is truthy; fail with a message after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
