"""The open-loop generator's HTTP/1.1 client: keep-alive connections as asyncio Protocols, parsed by httptools.

The generator shares this machine's cores with the server it measures, so its CPU per request is
taken from the server. aiohttp spends a task, a response object and a header multidict on each
request; here a request is one write on an idle connection and a response is parsed by llhttp
(httptools, the parser uvicorn runs) with callbacks that keep only the headers asked for.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import httptools


@dataclass(slots=True)
class Exchange:
    """One request: its payload, and what came back."""

    index: int
    payload: bytes
    sent: float
    attempts: int = 0
    status: int = 0
    """HTTP status; 0 when the connection failed or the request timed out."""
    headers: dict[bytes, bytes] | None = None
    """The headers asked for (lower-case names), when answered."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: "ConnectionPool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.answered = False
        """Some of the current response arrived (a request is resent only when nothing did)."""
        self.headers: dict[bytes, bytes] = {}
        self.closed = False

    def send(self, exchange: Exchange) -> None:
        self.exchange, self.answered, self.headers = exchange, False, {}
        self.pool.busy.add(self)
        self.transport.write(exchange.payload)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # connection_lost records the request as failed

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self.pool.keep_headers:
            self.headers[name] = value

    def on_message_complete(self) -> None:
        exchange, self.exchange = self.exchange, None
        self.pool.busy.discard(self)
        exchange.status, exchange.headers = self.parser.get_status_code(), self.headers
        keep = self.parser.should_keep_alive()
        self.pool.finished(exchange, self if keep else None)
        if not keep:
            self.closed = True
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool.busy.discard(self)
        self.pool.open -= 1
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        if not self.answered and exchange.attempts == 0:  # a keep-alive connection the server had closed
            exchange.attempts = 1
            self.pool.submit(exchange)
        else:
            self.pool.finished(exchange, None)


class ConnectionPool:
    """POSTs to one URL over at most `limit` keep-alive connections; `on_done(exchange)` per answer.

    A request beyond the limit waits for a connection. A request whose connection closes before
    any answer is resent once on another (the server may close an idle keep-alive connection just
    as it is reused); a request not answered within `timeout` seconds is closed with status 0.
    """

    def __init__(self, url: str, limit: int, timeout: float, keep_headers: set[bytes], on_done: Callable[[Exchange], None]):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.head = f"POST {parts.path or '/'} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\ncontent-length: ".encode()
        self.limit, self.timeout, self.keep_headers, self.on_done = limit, timeout, keep_headers, on_done
        self.loop = asyncio.get_running_loop()
        self.idle: deque[_Connection] = deque()
        self.waiting: deque[Exchange] = deque()
        self.busy: set[_Connection] = set()
        self.open = 0
        self._sweeper = self.loop.create_task(self._sweep())

    def request(self, body: bytes) -> bytes:
        """The whole request's bytes for a JSON body."""
        return self.head + str(len(body)).encode() + b"\r\n\r\n" + body

    def submit(self, exchange: Exchange) -> None:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                connection.send(exchange)
                return
        if self.open < self.limit:
            self.open += 1
            self.loop.create_task(self._connect(exchange))
        else:
            self.waiting.append(exchange)

    def finished(self, exchange: Exchange, connection: _Connection | None) -> None:
        """Record an answer (or a failure) and put its connection, if it stays open, to the next request."""
        self.on_done(exchange)
        if connection is None:
            if self.waiting and self.open < self.limit:
                self.open += 1
                self.loop.create_task(self._connect(self.waiting.popleft()))
        elif self.waiting:
            connection.send(self.waiting.popleft())
        else:
            self.idle.append(connection)

    def close(self) -> None:
        self._sweeper.cancel()
        for connection in [*self.idle, *self.busy]:
            connection.transport.close()

    async def _connect(self, exchange: Exchange) -> None:
        try:
            _, connection = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError:
            self.open -= 1
            self.finished(exchange, None)
            return
        connection.send(exchange)

    async def _sweep(self) -> None:
        """Close the connections of requests older than the timeout, once a second."""
        while True:
            await asyncio.sleep(1.0)
            late = time.monotonic() - self.timeout
            for connection in [c for c in self.busy if c.exchange is not None and c.exchange.sent < late]:
                connection.exchange.attempts = 1  # no resend for a request that timed out
                connection.transport.close()
