"""The open-loop load generator for streamed generation: SSE requests on schedule, every token's arrival.

Like autotune/bench/loadgen.py (arrivals never wait for answers; times from each request's
*scheduled* send time, wrk2-style), but each request is a `"stream": true` completion whose
server-sent events are read as they come: the arrival of every chunk that carries text is
kept, so time to first token (TTFT), the gaps between tokens (ITL) and the end-to-end time
all come from one record. At `cut_after` seconds the streams still open are closed (the
server cancels them): a step's judgment needs the tokens of its window, not the tails of
every request, and an overloaded step would otherwise last as long as its queue.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import numpy as np

from autotune.bench.loadgen import CONNECTIONS, Body, drive


@dataclass(frozen=True, slots=True)
class StreamResult:
    sent_at: float
    """Scheduled time, seconds after the run started."""
    status: int
    """HTTP status; 0 when the connection failed."""
    token_times: tuple[float, ...] = ()
    """Arrival of each chunk with text, seconds after the scheduled time (one chunk is one token
    unless detokenization held text back, e.g. half a UTF-8 character)."""
    latency: float = math.nan
    """Scheduled time to the stream's end (`data: [DONE]`); NaN when it did not end (cut, failed)."""
    lag: float = 0.0
    """Seconds the request left after its scheduled time (the generator's own delay)."""
    output_tokens: int = 0
    """The server's usage.completion_tokens, else the chunks counted."""
    prompt_tokens: int = 0
    """The server's usage.prompt_tokens; 0 when not reported."""
    error: str = ""
    """An error event inside a 200 stream, or why the request failed on the client side."""
    cut_at: float = math.nan
    """Seconds after the scheduled time when the generator closed the stream (run over); NaN if it was not cut."""

    @property
    def ok(self) -> bool:
        """No error and answered 200: finished, or still streaming when cut (or, cut, still waiting for its answer)."""
        waiting = self.status == 0 and not math.isnan(self.cut_at)
        return (self.status == 200 or waiting) and not self.error

    @property
    def completed(self) -> bool:
        return self.ok and not math.isnan(self.latency)

    @property
    def ttft(self) -> float:
        """Seconds to the first token; without one: the time a cut stream had waited (a lower
        bound), a finished stream's end (nothing it made had text); NaN for a failure."""
        if self.token_times:
            return self.token_times[0]
        if not self.ok:
            return math.nan
        return self.latency if math.isnan(self.cut_at) else self.cut_at

    def itls(self) -> np.ndarray:
        """Gaps between consecutive tokens (seconds); tokens − 1 of them for a finished stream."""
        return np.diff(np.asarray(self.token_times, dtype=float))


@dataclass
class _Stream:
    """What one request saw so far (the result is built from it, also when it is cut)."""

    due: float
    sent: float = math.nan
    status: int = 0
    times: list[float] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    done: float = math.nan
    error: str = ""
    cut: float = math.nan
    finished: bool = False
    """A chunk said finish_reason: a server that then closes the stream without `[DONE]` (transformers
    serve does) has still ended it."""

    def result(self, started: float) -> StreamResult:
        tokens = int(self.usage.get("completion_tokens", len(self.times))) if not math.isnan(self.done) else len(self.times)
        return StreamResult(
            sent_at=self.due - started, status=self.status, token_times=tuple(t - self.due for t in self.times),
            latency=self.done - self.due, lag=(self.sent if not math.isnan(self.sent) else self.due) - self.due,
            output_tokens=tokens, prompt_tokens=int(self.usage.get("prompt_tokens", 0)), error=self.error,
            cut_at=self.cut - self.due,
        )


def run(
    url: str,
    arrivals: list[float],
    body: Body,
    path: str = "/v1/completions",
    cut_after: float | None = None,
    on_tick: Callable[[float], None] | None = None,
    tick_seconds: float = 0.5,
    timeout: float = 300.0,
) -> list[StreamResult]:
    """Send request i at `arrivals[i]` seconds after the start and read its stream; streams
    still open `cut_after` seconds after the start are closed. One StreamResult per request, in order."""
    send = lambda started: _send_all(url.rstrip("/") + path, arrivals, body, cut_after, timeout, started)  # noqa: E731
    return drive(send, on_tick, tick_seconds, name="stream-loadgen-tick")


async def _send_all(url: str, arrivals: list[float], body: Body, cut_after: float | None, timeout: float, started: float) -> list[StreamResult]:
    connector = aiohttp.TCPConnector(limit=CONNECTIONS, keepalive_timeout=2.0)
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    streams: list[_Stream] = []
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout), headers=headers) as session:
        for i, offset in enumerate(arrivals):
            if cut_after is not None and offset >= cut_after:
                break  # scheduled after the cut: never sent (the caller's arrivals end before it)
            due = started + offset
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            streams.append(_Stream(due))
            payload = body(i) if callable(body) else body
            tasks.append(asyncio.create_task(_stream(session, url, payload, streams[-1])))
        if tasks:
            wait = None if cut_after is None else max(0.0, started + cut_after - time.monotonic())
            _, pending = await asyncio.wait(tasks, timeout=wait)
            cut = time.monotonic()
            for task, s in zip(tasks, streams):
                if task in pending:
                    s.cut = cut
                    task.cancel()  # closes the connection: the server sees the client leave and stops the generation
            await asyncio.gather(*pending, return_exceptions=True)
    return [s.result(started) for s in streams]


async def _stream(session: aiohttp.ClientSession, url: str, payload: bytes, s: _Stream) -> None:
    """POST, then read `data:` lines until `[DONE]`; every field of `s` is set as it happens."""
    s.sent = time.monotonic()
    try:
        async with session.post(url, data=payload) as response:
            s.status = response.status
            if response.status != 200:
                await response.read()
                return
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    s.done = time.monotonic()
                    return
                _event(s, json.loads(data))
                if s.error:
                    return
            if s.finished:
                s.done = time.monotonic()
            else:
                s.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        s.error = s.error or f"{type(exc).__name__}: {exc}"


def _event(s: _Stream, event: dict) -> None:
    """One SSE payload: a completions or chat chunk (text counts, role and finish chunks do not), usage, or an error."""
    if "error" in event:
        s.error = str(event["error"].get("message", event["error"]) if isinstance(event["error"], dict) else event["error"])
        return
    if event.get("usage"):
        s.usage = event["usage"]
    for choice in event.get("choices") or ():
        s.finished = s.finished or bool(choice.get("finish_reason"))
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            s.times.append(time.monotonic())
            return
