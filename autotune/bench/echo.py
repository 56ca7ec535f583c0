"""An endpoint that answers at once: shows the load generator is not the bottleneck.

    python -m autotune.bench.echo --port 8765

A raw ASGI app (no framework) under uvicorn, answering every POST with a small JSON body, so
that what limits the rate it serves is the client, not the model. `generator_check` offers a
rate against it and reports what the generator achieved and how much CPU it used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil

from autotune.bench import loadgen
from autotune.bench.server import free_port

BODY = b'{"object":"list","data":[]}'


CHUNK = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/v1/completions":  # a stream of max_tokens one-token chunks, at once
        tokens = int(json.loads(body or b"{}").get("max_tokens", 16))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(tokens):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})


def generator_check(rate: float, seconds: float, body: bytes, stream: bool = False) -> dict:
    """Offer `rate` req/s to a fresh echo server: achieved rate, send lag, the generator's CPU.
    `stream`: streamed completions (the body's max_tokens chunks each) through stream_loadgen."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "autotune.bench.echo", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, content=b"{}", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("echo server did not start")
                time.sleep(0.1)
        me = psutil.Process()
        cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
        arrivals = [k / rate for k in range(int(rate * seconds))]
        if stream:
            from autotune.bench import stream_loadgen

            results = stream_loadgen.run(url, arrivals, body)
        else:
            results = loadgen.run(url, arrivals, body, path="/")
        wall = time.monotonic() - t0
        cpu = (sum(me.cpu_times()[:2]) - cpu0) / wall
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    ok = [r for r in results if r.status == 200]
    if stream:
        ok = [r for r in ok if r.completed]
        return {"offered": rate, "achieved": len(ok) / max(max((r.sent_at + r.latency for r in ok), default=seconds), seconds),
                "ok_fraction": len(ok) / max(1, len(results)), "tokens_per_second": sum(len(r.token_times) for r in ok) / max(wall, 1e-9),
                "lag_p99_ms": float(np.percentile([r.lag for r in results], 99)) * 1000 if results else 0.0,
                "generator_cpu_cores": cpu}
    last = max((r.sent_at + r.latency for r in ok), default=seconds)
    return {
        "offered": rate,
        "achieved": len(ok) / max(last, seconds),
        "ok_fraction": len(ok) / max(1, len(results)),
        "lag_p99_ms": float(np.percentile([r.lag for r in results], 99)) * 1000 if results else 0.0,
        "latency_p99_ms": float(np.percentile([r.latency for r in ok], 99)) * 1000 if ok else float("nan"),
        "generator_cpu_cores": cpu,
    }


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="an HTTP endpoint that answers at once")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
