"""Generation peers on the same load: `selftune serve --task generate` against `transformers serve
--continuous-batching` and a naive `model.generate` server (benchmarks/naive_generate_server.py),
each measured by `selftune bench --task generate --url` (the same seeded arrivals, prompts and
objectives for all), one server at a time, in the order given, `--rounds` times with the order
reversed every other round (A B C, C B A).

    python benchmarks/gen_peers.py [--peers selftune,transformers-cb,naive] [--rounds 1] [--out gen-peers] [--quick] [--dtype bfloat16]
                                   [--start-rate 0.6] [--step-seconds 20]

Prints each run's max req/s within the objectives and output tokens/s, and writes every bench's
outputs under --out/ROUND-PEER/. `transformers serve` needs `accelerate` (pip install accelerate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

from autotune.bench.server import stop_session

HERE = os.path.dirname(os.path.abspath(__file__))


def model_dir() -> str:
    from engine.config import EngineConfig
    from engine.model_source import resolve_model

    return resolve_model("builtin:smollm2", EngineConfig().cache_dir).path


def command(peer: str, port: int, path: str, dtype: str = "float32") -> list[str]:
    if peer == "selftune":
        return ["selftune", "serve", "--model", "builtin:smollm2", "--task", "generate", "--dtype", dtype, "--port", str(port)]
    if peer == "transformers-cb":
        return ["transformers", "serve", path, "--continuous-batching", "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    if peer == "naive":
        return [sys.executable, os.path.join(HERE, "naive_generate_server.py"), path, "--port", str(port), "--dtype", dtype]
    raise ValueError(f"unknown peer {peer!r}")


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not come up in {timeout:.0f} s")


def measure(peer: str, out: str, quick: bool, dtype: str = "float32", port: int = 8041, ladder: list[str] = ()) -> dict:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(os.path.join(out, "server.log"), "w") as log:
        proc = subprocess.Popen(command(peer, port, model_dir(), dtype), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_up(url, proc)
            # --stop-at-eos: transformers serve refuses ignore_eos (422), so every peer stops at EOS (greedy: the same outputs everywhere).
            bench = ["selftune", "bench", "--task", "generate", "--url", url, "--stop-at-eos", "--no-generator-check", "--out", out, "--json"] + (["--quick"] if quick else []) + list(ladder)
            done = subprocess.run(bench, capture_output=True, text=True, env=env)
            with open(os.path.join(out, "bench.log"), "w") as f:
                f.write(done.stderr)
            if done.returncode != 0:
                raise RuntimeError(f"selftune bench failed for {peer}: {done.stderr[-2000:]}")
            summary = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            stop_session(proc, timeout=30)
    (result,) = summary["modes"]
    at = result.get("at_max") or {}
    return {"peer": peer, "max_qps": result["max_qps"], "output_tokens_per_s": at.get("output_tokens_per_s"),
            "goodput": at.get("goodput"), "ttft_p99": at.get("ttft_p99"), "itl_p99": at.get("itl_p99")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="selftune,transformers-cb,naive")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="gen-peers")
    parser.add_argument("--quick", action="store_true", help="selftune bench --quick (15-s steps)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every peer loads the model in this dtype")
    parser.add_argument("--start-rate", type=float, help="selftune bench --start-rate: the ladder's first rung (default 0.3 req/s)")
    parser.add_argument("--step-seconds", type=float, help="selftune bench --step-seconds: one rung's length")
    args = parser.parse_args()
    ladder = [f"--{k.replace('_', '-')}={v}" for k, v in (("start_rate", args.start_rate), ("step_seconds", args.step_seconds)) if v is not None]
    peers = args.peers.split(",")
    rows = []
    for r in range(args.rounds):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            out = os.path.join(args.out, f"{r + 1}-{peer}")
            os.makedirs(out, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}: {peer} (load {os.getloadavg()[0]:.2f})", flush=True)
            rows.append({"round": r + 1, **measure(peer, out, args.quick, args.dtype, ladder=ladder)})
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "peers.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
