"""The Ray path against plain `selftune serve` on one node (this machine), interleaved.

For each round, for each path (plain, then `--ray local:1`: one Ray node holding all of this
machine's CPUs): start the server, measure its max QPS within the p99 SLO with
`selftune bench --url` (the same ladder, texts and seed for both), then the CPU it spends per
request at a fixed rate, by process group (engine workers, the front / Ray's replica, Ray's proxy,
the rest of Ray), which says where the difference goes. Prints a table, writes ray_vs_plain.json
and each run's bench outputs (latency curves) under --out.

    python benchmarks/ray_vs_plain.py --rounds 2 --out benchmarks/out/ray
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil

from autotune.bench.server import free_port, stop_session


def start(path: str, port: int, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "autotune.cli", "serve", "--port", str(port)]
    if path.startswith("ray"):
        command += ["--ray", "local:1"]
    if path == "ray-haproxy":  # cluster.ingress: haproxy, Ray Serve's direct ingress
        config = os.path.join(os.path.dirname(log_path), "haproxy.yaml")
        with open(config, "w") as f:
            f.write("cluster: {ingress: haproxy}\n")
        command += ["--config", config]
    proc = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{path} server exited; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{path} server not ready in 300 s; see {log_path}")


def group(proc: psutil.Process) -> str:
    cmdline = " ".join(proc.cmdline()[:4])
    name = proc.name()
    if "engine.zygote" in cmdline or "engine.worker" in cmdline:
        return "engine workers + zygote"
    if name.startswith("ray::ServeRepli"):
        return "front (Ray replica)"
    if name.startswith("ray::ProxyActor"):
        return "Ray proxy"
    if name.startswith("ray::") or name in ("raylet", "gcs_server", "haproxy") or "ray/" in cmdline:
        return "Ray, other"
    if "autotune.cli" in cmdline and "serve" in cmdline:
        return "front (selftune serve)"
    return ""


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    out = {}
    for proc in psutil.process_iter():
        try:
            g = group(proc)
            if g:
                t = proc.cpu_times()
                out[proc.pid] = (g, t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def cpu_per_request(url: str, rate: float, seconds: float) -> dict[str, float]:
    """Milliseconds of CPU per request by process group at a fixed open-loop rate."""
    import asyncio

    import aiohttp

    body = {"model": "all-MiniLM-L6-v2", "input": ["the cost of one request through each path, measured in cpu time"]}

    async def run() -> int:
        ok = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one():
                nonlocal ok
                async with session.post(f"{url}/v1/embeddings", json=body) as r:
                    await r.read()
                    ok += r.status == 200

            begin, tasks = time.perf_counter(), []
            for i in range(int(rate * seconds)):
                await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)
        return ok

    before = cpu_snapshot()
    ok = asyncio.run(run())
    after = cpu_snapshot()
    used: Counter = Counter()
    for pid, (g, t) in after.items():
        used[g] += t - (before[pid][1] if pid in before else 0.0)
    return {g: round(1000 * v / max(ok, 1), 2) for g, v in sorted(used.items())} | {"requests ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=40.0, help="fixed rate of the CPU-per-request measurement")
    parser.add_argument("--out", default="benchmarks/out/ray")
    parser.add_argument("--full", action="store_true", help="the full ladder (default: --quick)")
    parser.add_argument("--haproxy", action="store_true", help="also cluster.ingress: haproxy, Ray Serve's direct ingress (ray-haproxy)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for round_ in range(1, args.rounds + 1):
        for path in ("plain", "ray") + (("ray-haproxy",) if args.haproxy else ()):
            port = free_port()
            tag = f"{path}-{round_}"
            print(f"[{time.strftime('%H:%M:%S')}] {tag}: starting", flush=True)
            proc = start(path, port, os.path.join(args.out, f"{tag}.log"))
            try:
                url = f"http://127.0.0.1:{port}"
                bench = [sys.executable, "-m", "autotune.cli", "bench", "--url", url, "--no-limit", "--no-generator-check",
                         "--out", os.path.join(args.out, tag), "--json"] + ([] if args.full else ["--quick"])
                done = subprocess.run(bench, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0 or not done.stdout.strip():
                    raise RuntimeError(f"{tag}: the bench failed ({done.returncode}): {done.stderr[-2000:]}")
                report = json.loads(done.stdout.strip().splitlines()[-1])
                mode = report["modes"][0]
                cpu = cpu_per_request(url, args.rate, 20.0)
            finally:
                stop_session(proc)
            row = {"path": path, "round": round_, "max_qps": mode["max_qps"], "p99_at_max_ms": 1000 * mode["at_max"]["p99"],
                   "items_per_forward": mode["at_max"].get("batch_items"), "cpu_ms_per_request": cpu}
            results.append(row)
            print(f"[{time.strftime('%H:%M:%S')}] {tag}: max {row['max_qps']:.1f} req/s, CPU per request {cpu}", flush=True)
    with open(os.path.join(args.out, "ray_vs_plain.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| path | round | max QPS (p99 <= 500 ms) | p99 at max (ms) | CPU ms per request by process group |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['round']} | {r['max_qps']:.1f} | {r['p99_at_max_ms']:.0f} | {r['cpu_ms_per_request']} |")
    for round_ in range(1, args.rounds + 1):
        plain = next(r for r in results if r["round"] == round_ and r["path"] == "plain")
        for other in (r for r in results if r["round"] == round_ and r["path"] != "plain"):
            print(f"round {round_}: {other['path']} / plain = {other['max_qps'] / plain['max_qps']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
