"""CPU the server's front process spends per request, thread by thread, at a fixed rate.

On a machine where the front, the workers and the clients share the cores, every
millisecond the front spends on a request is taken from the workers. This starts one
`selftune serve` (fixed knobs, autotuning off), sends `--rate` single-text embedding requests
per second for `--seconds` (the bench's texts and seeded order), and reports CPU per request
of the front process (and of each of its threads: the event loop and the others, among them
the engine core),
of each worker, and of the load generator itself.

    python benchmarks/front_cpu.py [--rate 150] [--seconds 20] [--knobs process_count=2,...] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile

import numpy as np
import psutil

from autotune.bench import loadgen
from autotune.bench.inputs import sentences
from autotune.bench.modes import Mode, parse_knobs
from autotune.bench.runner import RunLog, embed_body, start_server, wait_idle, warm_up

KNOBS = "process_count=2,threads_per_process=1,io_threads=0,batch_timeout=0.005,max_batch_size=32"


def cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def thread_cpu(process: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in process.threads()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--knobs", default=KNOBS, help="the server's fixed knobs (name=value,...)")
    ap.add_argument("--model", default="builtin:minilm")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    knobs = parse_knobs(args.knobs)
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(Mode("front-cpu", knobs), args.model, workdir)
        try:
            log = RunLog(server.url)
            warm_up(log, 10.0, 2.0, embed_body(["warm-up words"], 0))
            log.close()
            wait_idle(server.url)
            front = psutil.Process(server.proc.pid)
            workers = front.children(recursive=True)
            client = psutil.Process()
            arrivals = [i / args.rate for i in range(int(args.rate * args.seconds))]
            print(f"front_cpu: {len(arrivals)} requests at {args.rate:g}/s against {knobs}", file=sys.stderr)
            before = (cpu(front), thread_cpu(front), [cpu(w) for w in workers], cpu(client))
            results = loadgen.run(server.url, arrivals, embed_body(sentences(512, 8, 48), 0), on_tick=_progress(args.seconds), tick_seconds=5.0)
            after = (cpu(front), thread_cpu(front), [cpu(w) for w in workers], cpu(client))
        finally:
            server.stop()
    n = len(results)
    ok = [r for r in results if r.status == 200]
    latency = np.array([r.latency for r in ok]) * 1000
    per_request = lambda seconds: round(seconds / n * 1000, 3)  # noqa: E731
    threads = {
        ("event-loop" if tid == front.pid else f"thread-{tid}"): per_request(t - before[1].get(tid, 0.0))
        for tid, t in sorted(after[1].items(), key=lambda kv: before[1].get(kv[0], 0.0) - kv[1])
        if t - before[1].get(tid, 0.0) > 0.005
    }
    result = {
        "rate": args.rate,
        "requests": n,
        "ok": len(ok),
        "knobs": dataclasses.asdict(knobs),
        "p50_ms": float(np.percentile(latency, 50)) if ok else None,
        "p99_ms": float(np.percentile(latency, 99)) if ok else None,
        "front_ms_per_request": per_request(after[0] - before[0]),
        "front_threads_ms_per_request": threads,
        "workers_ms_per_request": [per_request(b - a) for a, b in zip(before[2], after[2]) if b - a > 0.005],
        "load_generator_ms_per_request": per_request(after[3] - before[3]),
    }
    print(
        f"front {result['front_ms_per_request']} ms/request ({', '.join(f'{k} {v}' for k, v in threads.items())}); "
        f"workers {result['workers_ms_per_request']}; load generator {result['load_generator_ms_per_request']}; "
        f"ok {len(ok)}/{n}, p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms"
    )
    if args.json:
        print(json.dumps(result))
    return 0


def _progress(total: float):
    def tick(elapsed: float) -> None:
        print(f"front_cpu: {elapsed:.0f}/{total:g} s", file=sys.stderr)

    return tick


if __name__ == "__main__":
    sys.exit(main())
