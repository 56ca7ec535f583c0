"""Shared pieces of the GPU check: step outcomes, progress lines, HTTP over urllib, small maths.

Standard library only: this module is imported before anything is known to be installed.
"""

from __future__ import annotations

import json
import math
import re
import socket
import sys
import time
import urllib.error
import urllib.request

STARTED = time.monotonic()


class Skip(Exception):
    """A step that cannot run here; the message is the reason recorded."""


class Fail(Exception):
    """A check that did not hold; `details` are recorded with the message."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


def say(message: str) -> None:
    """One progress line on stderr, with the seconds since the driver started."""
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- HTTP ----------------------------------------------------------------------------------

def http(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes, dict]:
    """(status, body bytes, headers) of one request; HTTP errors are answers, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"content-type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers or {})


def get_json(url: str, timeout: float = 30.0) -> dict:
    status, body, _ = http("GET", url, timeout=timeout)
    if status != 200:
        raise Fail(f"GET {url} answered {status}: {body[:300]!r}")
    return json.loads(body)


def post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    status, data, _ = http("POST", url, body, timeout=timeout)
    if status != 200:
        raise Fail(f"POST {url} answered {status}: {data[:500]!r}")
    return json.loads(data)


def sse(url: str, body: dict, timeout: float = 120.0):
    """Yield (monotonic time, parsed event) for each `data:` line of a streamed response."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            yield time.monotonic(), json.loads(payload)


def metrics(url: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {family: [(labels, value), ...]} (samples only, comments dropped)."""
    status, body, _ = http("GET", url + "/metrics", timeout=15)
    if status != 200:
        raise Fail(f"GET /metrics answered {status}")
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in body.decode().splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not match or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        out.setdefault(match.group(1), []).append((labels, float(match.group(3))))
    return out


# --- maths ---------------------------------------------------------------------------------

def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def rounded(value, digits: int = 4):
    """`value` rounded; None for None, NaN and infinities (so that the JSON stays valid)."""
    if value is None or not math.isfinite(float(value)):
        return None
    return round(float(value), digits)


# --- a YAML writer for the temporary server configs ------------------------------------------

def to_yaml(data: dict, indent: int = 0) -> str:
    """Nested dicts of scalars and lists -> block YAML (strings double-quoted, JSON-style)."""
    lines = []
    for key, value in data.items():
        pad = " " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(lines) + "\n"


def _scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    return json.dumps(str(value))
