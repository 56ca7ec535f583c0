"""Soak: serve for a long time with periodic re-tunes; report RSS and fd counts over time.

Starts `selftune serve` (2 CPU workers), sends open-loop embedding traffic, re-tunes the
knobs through the admin API every `--retune-seconds`, and samples every process of the server
(front, zygote, workers) every `--sample-seconds`: PSS and RSS, open fds (all, and those that
are not TCP connections: client keep-alive connections come and go with the load), threads. After the
warm-up (the first fifth of the run), it compares the mean of the first and last tenth of the
remaining samples taken at the most common process count; growth above `--max-growth` (5 %) in the front process's RSS or non-TCP fd count,
or in the USS summed over all its processes, fails the run (exit 1). (PSS is recorded too,
but it splits shared library pages among every process on the machine that maps them, so it
moves when unrelated processes start or stop.)

`--plant-leak MB_PER_MIN` runs the same server with a thread that keeps allocating (the
positive control: it must fail).

    python benchmarks/soak.py --minutes 30 --out benchmarks/out/soak
    python benchmarks/soak.py --minutes 8 --plant-leak 20 --out benchmarks/out/soak-leak
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import yaml

from autotune.bench.server import free_port
from autotune.bench.loadgen import open_loop

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN = "soak-admin-token"


def start_server(port: int, leak_mb_per_min: float, workdir: str) -> subprocess.Popen:
    config = {
        "server": {"port": port, "log_level": "warning"},
        "concurrency": {"process_count": 2, "max_batch_size": 16},
        "autotune": {"enabled": False},
    }
    path = os.path.join(workdir, "soak.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    command = [sys.executable, "-m", "autotune.cli", "serve", "--config", path]
    if leak_mb_per_min:
        command = [sys.executable, os.path.join(HERE, "soak_leaky_server.py"), str(leak_mb_per_min), "serve", "--config", path]
    proc = subprocess.Popen(command, env={**os.environ, "SELFTUNE_ADMIN_TOKEN": TOKEN})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def sample(front: psutil.Process, started: float) -> dict:
    procs = [front] + front.children(recursive=True)
    pss = uss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            pss += info.pss
            uss += info.uss
        except psutil.Error:
            pass
    return {
        "t": round(time.monotonic() - started, 1),
        "front_rss_mib": front.memory_info().rss / 2**20,
        "front_fds": front.num_fds(),
        # client keep-alive connections come and go with the load; the rest would show a leak
        "front_fds_not_tcp": front.num_fds() - len(front.net_connections(kind="tcp")),
        "front_threads": front.num_threads(),
        "total_pss_mib": pss / 2**20,
        # PSS splits shared pages (libtorch...) among every process on the machine that maps
        # them, so it moves when unrelated processes come and go; USS is what the server owns.
        "total_uss_mib": uss / 2**20,
        "processes": len(procs),
    }


def growth(rows: list[dict], key: str) -> float:
    """Relative change of `key` from the first to the last tenth of the post-warm-up samples.

    Re-tunes move the worker count, and each worker brings its own fds and PSS, so only the
    samples taken at the most common process count are compared with each other.
    """
    steady = rows[len(rows) // 5 :]
    modal = statistics.mode(r["processes"] for r in steady)
    steady = [r for r in steady if r["processes"] == modal]
    tenth = max(1, len(steady) // 10)
    first = statistics.fmean(r[key] for r in steady[:tenth])
    last = statistics.fmean(r[key] for r in steady[-tenth:])
    return (last - first) / first if first else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--rate", type=float, default=15, help="requests per second")
    ap.add_argument("--retune-seconds", type=float, default=20)
    ap.add_argument("--sample-seconds", type=float, default=10)
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--plant-leak", type=float, default=0.0, metavar="MB_PER_MIN")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    port = free_port()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as workdir:
        server = start_server(port, args.plant_leak, workdir)
        front = psutil.Process(server.pid)
        rows: list[dict] = []
        started = time.monotonic()
        state = {"next_sample": 0.0, "next_retune": args.retune_seconds}

        def on_tick(elapsed: float) -> None:
            if elapsed >= state["next_sample"]:
                state["next_sample"] += args.sample_seconds
                rows.append(sample(front, started))
                r = rows[-1]
                print(f"[{r['t']:7.1f}s] front RSS {r['front_rss_mib']:.1f} MiB, fds {r['front_fds']} ({r['front_fds_not_tcp']} not TCP), "
                      f"threads {r['front_threads']}, total USS {r['total_uss_mib']:.1f} MiB, PSS {r['total_pss_mib']:.1f} MiB, "
                      f"{r['processes']} processes", file=sys.stderr, flush=True)
            if elapsed >= state["next_retune"]:
                state["next_retune"] += args.retune_seconds
                knobs = {"process_count": rng.choice([1, 2]), "max_batch_size": rng.choice([4, 8, 16, 32]), "batch_timeout": rng.choice([0.0, 0.002, 0.01])}
                httpx.put(f"http://127.0.0.1:{port}/admin/knobs", json=knobs, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)

        body = json.dumps({"model": "all-MiniLM-L6-v2", "input": "a sentence served again and again during the soak"}).encode()
        try:
            results = open_loop("127.0.0.1", port, [(args.rate, args.minutes * 60)], body, on_tick=on_tick)
        finally:
            server.terminate()
            server.wait(timeout=60)
    statuses = {s: sum(1 for r in results if r.status == s) for s in {r.status for r in results}}
    report = {
        "minutes": args.minutes,
        "requests": len(results),
        "statuses": statuses,
        "planted_leak_mb_per_min": args.plant_leak,
        "growth": {k: growth(rows, k) for k in ("front_rss_mib", "front_fds_not_tcp", "total_uss_mib")},
        "first": rows[len(rows) // 5] if rows else None,
        "last": rows[-1] if rows else None,
    }
    failed = [k for k, g in report["growth"].items() if g > args.max_growth]
    report["passed"] = not failed and set(statuses) == {200}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, os.path.join(args.out, "soak.png"))
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(report, f, indent=2)
    print(f"soak: {report['requests']} requests {statuses}; growth after warm-up: "
          + ", ".join(f"{k} {g * 100:+.1f}%" for k, g in report["growth"].items())
          + (" -> PASS" if report["passed"] else f" -> FAIL ({', '.join(failed) or 'errors'})"), file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    return 0 if report["passed"] else 1


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] / 60 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].plot(t, [r["front_rss_mib"] for r in rows], label="front RSS")
    axes[0].plot(t, [r["total_pss_mib"] for r in rows], label="all processes PSS")
    axes[0].plot(t, [r["total_uss_mib"] for r in rows], label="all processes USS")
    axes[0].set_ylabel("MiB")
    axes[0].legend()
    axes[1].plot(t, [r["front_fds"] for r in rows])
    axes[1].set_ylabel("front fds")
    axes[2].plot(t, [r["front_threads"] for r in rows])
    axes[2].set_ylabel("front threads")
    axes[2].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
