"""Indexing clients, closed loop: K clients each sending requests of N texts back to back (what a
batch indexing job does, unlike the bench's open-loop ladder), against `selftune serve` as shipped,
with the served backend's in-process limit measured in the same run.

    python benchmarks/indexing_clients.py [--texts 32] [--clients 1,2,4,8] [--seconds 20] [--rounds 2] [--json]

Per K: sentences/s, requests/s and latency p50/p99; and sentences/s over the limit. Rounds run the
client counts in turn, the order reversed every other round (the VM drifts within minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np


async def closed_loop(url: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    import aiohttp

    latencies: list[float] = []
    failures = 0
    end = time.perf_counter() + seconds

    async def client(session, offset: int) -> None:
        nonlocal failures
        i = offset
        while time.perf_counter() < end:
            started = time.perf_counter()
            async with session.post(url + "/v1/embeddings", data=bodies[i % len(bodies)], headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    failures += 1
                    continue
            latencies.append(time.perf_counter() - started)
            i += clients

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, k) for k in range(clients)))
    wall = time.perf_counter() - started
    lat = np.array(latencies)
    return {"clients": clients, "requests_per_second": len(lat) / wall, "failures": failures,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=32, help="texts per request")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-limit", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from autotune.bench.inputs import sentences
    from autotune.bench.limit import measure_limit
    from autotune.bench.server import ServerProcess
    from engine.model_source import resolve_model

    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    texts = sentences(max(512, 16 * args.texts), 8, 48, seed=0)
    limit = None
    if not args.no_limit:
        path = resolve_model("builtin:minilm", "/nonexistent").path
        limit = measure_limit(path, texts, len(os.sched_getaffinity(0)), say=say).best.sentences_per_second
        say(f"limit (the served backend, in-process): {limit:.0f} sentences/s")
    bodies = [json.dumps({"model": "all-MiniLM-L6-v2", "input": texts[i : i + args.texts]}).encode() for i in range(0, len(texts) - args.texts, args.texts)]
    server = ServerProcess(tempfile.mkdtemp(prefix="indexing-"), {"model": {"name": "builtin:minilm"}, "server": {"log_level": "warning"}})
    rows = []
    try:
        counts = [int(k) for k in args.clients.split(",")]
        for r in range(args.rounds):
            for k in counts if r % 2 == 0 else counts[::-1]:
                row = asyncio.run(closed_loop(server.url, bodies, k, args.seconds))
                row.update(round=r + 1, sentences_per_second=row["requests_per_second"] * args.texts)
                if limit:
                    row["of_limit"] = row["sentences_per_second"] / limit
                rows.append(row)
                say(f"round {r + 1}, {k} clients: {row['sentences_per_second']:.0f} sentences/s, p50 {row['p50_ms']:.0f} ms, "
                    f"p99 {row['p99_ms']:.0f} ms" + (f", {row['of_limit']:.2f} × the limit" if limit else ""))
    finally:
        server.stop()
    if args.json:
        print(json.dumps({"texts_per_request": args.texts, "limit": limit, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
