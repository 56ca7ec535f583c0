"""An open-loop HTTP load generator: arrivals are scheduled, never wait for answers.

Used by the soak script, the benchmarks and the live tests. Requests go out from a pool of
keep-alive connections at the scheduled times, so queueing in the server shows up as latency
(a closed loop would hide it by slowing down).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class Result:
    sent_at: float
    """Seconds after the run started."""
    status: int
    latency: float


def open_loop(
    host: str,
    port: int,
    steps: list[tuple[float, float]],
    body: bytes | Callable[[int], bytes],
    path: str = "/v1/embeddings",
    connections: int = 32,
    on_tick: Callable[[float], None] | None = None,
    tick_seconds: float = 0.5,
) -> list[Result]:
    """Send `rate` requests per second for `seconds`, for each (rate, seconds) step.

    `on_tick(elapsed)` runs about every `tick_seconds` on the scheduling thread (progress
    lines, sampling the server). A status of 0 means the connection failed.
    """
    local = threading.local()

    def post(payload: bytes) -> int:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            local.conn.request("POST", path, payload, {"content-type": "application/json"})
            response = local.conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            local.conn.close()
            del local.conn
            return 0

    def send(i: int, scheduled: float) -> Result:
        payload = body(i) if callable(body) else body
        started = time.perf_counter()
        reused = hasattr(local, "conn")
        status = post(payload)
        if status == 0 and reused:
            status = post(payload)  # the server closed an idle keep-alive connection: retry on a new one
        return Result(scheduled, status, time.perf_counter() - started)

    futures = []
    with concurrent.futures.ThreadPoolExecutor(connections) as pool:
        start = time.monotonic()
        next_tick = start
        offset = 0.0
        index = 0
        for rate, seconds in steps:
            for k in range(int(rate * seconds)):
                due = start + offset + k / rate
                while (now := time.monotonic()) < due:
                    if on_tick is not None and now >= next_tick:
                        on_tick(now - start)
                        next_tick = now + tick_seconds
                    time.sleep(min(0.005, max(0.0, due - time.monotonic())))
                futures.append(pool.submit(send, index, due - start))
                index += 1
            offset += seconds
        return [f.result() for f in futures]
