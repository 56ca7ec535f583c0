"""An open-loop HTTP load generator on asyncio + httpx: arrivals are scheduled, never wait for answers.

Used by `selftune bench`, `selftune validate`, the soak script and the live tests. aiohttp,
not httpx: on one core httpx's async client tops out near 360 requests/s against an endpoint
that answers at once, aiohttp holds 1,500/s with a 99th-percentile send lag of 14 ms. Every
request is a task started at its scheduled time, so queueing in the server shows up as latency
(a closed loop would hide it by slowing down). Latency is measured from the *scheduled* time,
the way wrk2 does it: if the generator itself falls behind, that shows as latency too, and as
`lag` (how late the request left), which the caller can check to prove the generator was not
the bottleneck.

`on_tick` runs on its own thread, so a slow callback (sampling processes, calling the admin
API) never delays the arrivals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp

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
    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=2.0)
    session_timeout = aiohttp.ClientTimeout(total=timeout)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=session_timeout, headers=headers) as session:

        async def one(i: int, due: float) -> Result:
            payload = body(i) if callable(body) else body
            sent = time.monotonic()
            status, stages, batch = await _post(session, url, payload)
            done = time.monotonic()
            return Result(due - started, status, done - due, sent - due, stages, batch)

        tasks = []
        for i, offset in enumerate(arrivals):
            due = started + offset
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        return list(await asyncio.gather(*tasks))


async def _post(session: aiohttp.ClientSession, url: str, payload: bytes) -> tuple[int, dict[str, float], tuple[int, ...]]:
    """POST once more if the server closed a keep-alive connection under us; status 0 if it fails."""
    for attempt in range(2):
        try:
            async with session.post(url, data=payload) as response:
                await response.read()
                stages = {name: float(response.headers[h]) / 1000 for name, h in STAGE_HEADERS.items() if h in response.headers}
                batch = tuple(int(x) for x in response.headers.get(BATCH_HEADER, "").split(",") if x)
                return response.status, stages, batch
        except (aiohttp.ClientError, asyncio.TimeoutError):
            if attempt == 0:
                continue
    return 0, {}, ()
