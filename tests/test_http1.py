"""The load generator's HTTP/1.1 client against a raw socket server whose misbehaviour the test controls."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from autotune.bench import loadgen
from autotune.bench.server import free_port

ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-selftune-model-ms: 12.500\r\n"
    b"X-Selftune-Batch: 3,2,16\r\ncontent-length: 2\r\n\r\n{}"
)


class RawServer:
    """An HTTP/1.1 server on its own thread: `behave(connection's request number, body)` returns
    the bytes to answer with, b"" to close without answering, or None to never answer."""

    def __init__(self, behave, delay: float = 0.0):
        self.behave, self.delay = behave, delay
        self.port = free_port()
        self.requests = 0
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            for number in range(1_000_000):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests += 1
                await asyncio.sleep(self.delay)
                answer = self.behave(number, body)
                if answer is None:
                    await asyncio.sleep(3600)
                if not answer:
                    return
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open_now -= 1
            writer.close()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def raw_server():
    servers = []

    def start(behave, delay: float = 0.0) -> RawServer:
        servers.append(RawServer(behave, delay))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_answers_keep_their_order_status_stage_times_and_batch(raw_server):
    server = raw_server(lambda number, body: ANSWER.replace(b"200 OK", b"429 Too Many Requests") if body == b'{"i": 3}' else ANSWER)
    results = loadgen.run(f"http://127.0.0.1:{server.port}", [k / 200 for k in range(20)], lambda i: b'{"i": %d}' % i, path="/x")
    assert [r.status for r in results] == [200, 200, 200, 429] + [200] * 16
    assert results[0].stages == {"model": 0.0125} and results[0].batch == (3, 2, 16)
    assert [r.sent_at for r in results] == pytest.approx([k / 200 for k in range(20)])
    assert all(r.latency >= r.lag >= 0 for r in results)
    assert server.requests == 20 and server.connections <= 3  # kept alive, not one connection a request


def test_a_request_on_a_connection_the_server_closed_is_sent_again_once(raw_server):
    server = raw_server(lambda number, body: ANSWER if number == 0 else b"")  # each connection answers once, then drops
    results = loadgen.run(f"http://127.0.0.1:{server.port}", [k * 0.05 for k in range(6)], b"{}")
    assert [r.status for r in results] == [200] * 6
    assert server.requests == 11  # the first, then five that went out twice: on a dropped connection, then a new one


def test_a_request_the_server_never_answers_fails_at_the_timeout_and_the_rest_go_on(raw_server):
    server = raw_server(lambda number, body: None if body == b"hang" else ANSWER)
    started = time.monotonic()
    results = loadgen.run(f"http://127.0.0.1:{server.port}", [0.0, 0.1, 0.2], lambda i: b"hang" if i == 1 else b"{}", timeout=1.0)
    assert [r.status for r in results] == [200, 0, 200]
    assert 1.0 <= results[1].latency < 3.0 and time.monotonic() - started < 5.0
    assert server.requests == 3  # a timed-out request is not sent again


def test_more_requests_than_connections_wait_for_one(raw_server):
    server = raw_server(lambda number, body: ANSWER, delay=0.1)
    results = loadgen.run(f"http://127.0.0.1:{server.port}", [0.0] * 10, b"{}", connections=2)
    assert [r.status for r in results] == [200] * 10
    assert server.most_open <= 2
    assert max(r.latency for r in results) >= 0.45  # five rounds of 0.1 s on two connections


def test_a_refused_connection_is_status_zero():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        results = loadgen.run(f"http://127.0.0.1:{port}", [0.0, 0.01], b"{}")
    assert [r.status for r in results] == [0, 0]
