"""An open-loop HTTP load generator: arrivals are scheduled, never wait for answers.

Used by `selftune bench`, `selftune validate`, the soak script and the live tests. Each request
goes out at its scheduled time on an idle keep-alive connection (autotune/bench/http1.py), so
queueing in the server shows up as latency (a closed loop would hide it by slowing down).
Latency is measured from the *scheduled* time, the way wrk2 does it: if the generator itself
falls behind, that shows as latency too, and as `lag` (how late the request left), which the
caller can check to prove the generator was not the bottleneck. The generator runs on the cores
it measures, so it is built to spend little CPU a request.

`on_tick` runs on its own thread, so a slow callback (sampling processes, calling the admin
API) never delays the arrivals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from autotune.bench.http1 import ConnectionPool, Exchange
from engine.heap import freeze_startup_heap

STAGE_HEADERS = {
    "preprocess": "x-selftune-preprocess-ms",
    "queue": "x-selftune-queue-ms",
    "model": "x-selftune-model-ms",
    "server": "x-selftune-total-ms",
}
"""Stage timings the server reports per response (milliseconds), by the name results use."""

CONNECTIONS = 4096
"""At most this many requests on the wire. Well above a server's admission limit (512 by
default), so an overload reaches the server and its 429s, as independent clients would, instead
of queueing inside the generator (with 512, the server never saw more than its limit and never
refused: a 180 req/s overload measured 13 s of client-side waiting)."""

BATCH_HEADER = "x-selftune-batch"
"""The batch a response's input ran in: `items,rows,tokens per row`."""

_STAGE_KEYS = {name: header.encode() for name, header in STAGE_HEADERS.items()}
_BATCH_KEY = BATCH_HEADER.encode()


@dataclass(frozen=True, slots=True)
class Result:
    sent_at: float
    """Scheduled time, seconds after the run started."""
    status: int
    """HTTP status; 0 when the connection failed."""
    latency: float
    """Seconds from the scheduled time to the whole response."""
    lag: float = 0.0
    """Seconds the request left after its scheduled time (the generator's own delay)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Server-reported stage times in seconds (preprocess, queue, model, server), when sent."""
    batch: tuple[int, ...] = ()
    """Server-reported batch (items, rows, tokens per row), when sent."""


Body = bytes | Callable[[int], bytes]


def arrivals_from_steps(steps: list[tuple[float, float]]) -> list[float]:
    """Evenly spaced arrival times: `rate` per second for `seconds`, for each (rate, seconds)."""
    times: list[float] = []
    offset = 0.0
    for rate, seconds in steps:
        times.extend(offset + k / rate for k in range(int(rate * seconds)))
        offset += seconds
    return times


def run(
    url: str,
    arrivals: list[float],
    body: Body,
    path: str = "/v1/embeddings",
    connections: int = CONNECTIONS,
    on_tick: Callable[[float], None] | None = None,
    tick_seconds: float = 0.5,
    timeout: float = 120.0,
) -> list[Result]:
    """Send request i at `arrivals[i]` seconds after the start; one Result per request, in order.

    At most `connections` requests are on the wire at once (a request beyond that waits for a
    connection, and its latency includes the wait).
    """
    return drive(lambda started: _send_all(url.rstrip("/") + path, arrivals, body, connections, timeout, started), on_tick, tick_seconds)


def drive(send: Callable[[float], Awaitable[list]], on_tick: Callable[[float], None] | None, tick_seconds: float, name: str = "loadgen-tick") -> list:
    """Run `send(started)` on a fresh event loop, with `on_tick(elapsed)` every `tick_seconds`
    on a thread of its own meanwhile (the plain and the streaming generator both run this way)."""
    freeze_startup_heap()  # a full collection of the caller's imports would delay arrivals by tens of ms
    stop = threading.Event()
    started = time.monotonic()
    ticker = None
    if on_tick is not None:
        ticker = threading.Thread(target=_tick, args=(on_tick, started, tick_seconds, stop), name=name, daemon=True)
        ticker.start()
    try:
        return asyncio.run(send(started))
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()


def open_loop(
    host: str,
    port: int,
    steps: list[tuple[float, float]],
    body: Body,
    path: str = "/v1/embeddings",
    connections: int = CONNECTIONS,
    on_tick: Callable[[float], None] | None = None,
    tick_seconds: float = 0.5,
) -> list[Result]:
    """`run` with evenly spaced arrivals at `rate` per second for each (rate, seconds) step."""
    return run(f"http://{host}:{port}", arrivals_from_steps(steps), body, path, connections, on_tick, tick_seconds)


def _tick(on_tick: Callable[[float], None], started: float, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        on_tick(time.monotonic() - started)


async def _send_all(url: str, arrivals: list[float], body: Body, connections: int, timeout: float, started: float) -> list[Result]:
    if not arrivals:
        return []
    results: list[Result | None] = [None] * len(arrivals)
    due = [started + offset for offset in arrivals]
    all_done = asyncio.get_running_loop().create_future()
    remaining = len(arrivals)

    def done(exchange: Exchange) -> None:
        nonlocal remaining
        i, headers = exchange.index, exchange.headers or {}
        stages = {name: float(headers[h]) / 1000 for name, h in _STAGE_KEYS.items() if h in headers}
        batch = tuple(int(x) for x in headers.get(_BATCH_KEY, b"").split(b",") if x)
        results[i] = Result(due[i] - started, exchange.status, time.monotonic() - due[i], exchange.sent - due[i], stages, batch)
        remaining -= 1
        if remaining == 0:
            all_done.set_result(None)

    pool = ConnectionPool(url, connections, timeout, {*_STAGE_KEYS.values(), _BATCH_KEY}, done)
    fixed = None if callable(body) else pool.request(body)
    try:
        for i, at in enumerate(due):
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            pool.submit(Exchange(i, fixed if fixed is not None else pool.request(body(i)), time.monotonic()))
        await all_done
    finally:
        pool.close()
    return results  # type: ignore[return-value]
