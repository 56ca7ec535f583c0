"""ASGI middleware that records each API request's end-to-end latency ("total" stage).

It runs outermost, so the time covers parsing, validation, the engine and sending the whole
response (a stream included): the figure a client would measure, less the network.
"""

from __future__ import annotations

import time

from engine.stats import LatencyHistograms


class RequestTiming:
    def __init__(self, app, latency: LatencyHistograms, prefix: str = "/v1/"):
        self.app = app
        self.latency = latency
        self.prefix = prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        started = time.monotonic()

        async def timed_send(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.latency.record("total", time.monotonic() - started)

        await self.app(scope, receive, timed_send)
