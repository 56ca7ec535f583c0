"""Record a generating engine's Observations under a light then a heavy closed-loop load, as JSON
(the generation policy's tests replay such a recording: tests/fixtures/observations/).

    python benchmarks/record_gen_observations.py --model builtin:smollm2 --out obs.json
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time


def drive(engine, stop: threading.Event, prompt_tokens: int, max_tokens: int, seed: int) -> None:
    """One closed-loop client: a prompt of random ids, read the whole stream, again."""
    from engine.jobs import EngineClosed
    from engine.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.info.vocab_size
    while not stop.is_set():
        prompt = [rng.randrange(1000, vocab - 1) for _ in range(prompt_tokens)]
        try:
            for _ in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)):
                pass
        except EngineClosed:
            return  # the recording is over


def phase(engine, telemetry, name: str, seconds: float, clients: int, prompt_tokens: int, max_tokens: int, out: list) -> None:
    stop = threading.Event()
    threads = [threading.Thread(target=drive, args=(engine, stop, prompt_tokens, max_tokens, i), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(1.0)
        obs = telemetry.sample_now().as_dict()
        for key in ("host", "numa", "gpu"):
            obs.pop(key, None)
        out.append({"phase": name, "knobs": engine.knobs.as_dict(), "observation": obs})
        itl = obs["load"]["latency"].get("itl") or {}
        print(f"{name} t={obs['time']:.0f} itl_p99={itl.get('p99')} ttft_p99={(obs['load']['latency'].get('ttft') or {}).get('p99')}", flush=True)
    stop.set()  # clients still in a generation finish it in the next phase (or are cut at shutdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--out", default="gen_observations.json")
    parser.add_argument("--seconds", type=float, default=30.0, help="per phase")
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()

    from autotune.telemetry import Telemetry
    from engine.config import EngineConfig, Knobs
    from engine.engine import Engine

    knobs = Knobs(process_count=1, threads_per_process=2, max_batch_size=16, max_batch_tokens=512)
    records: list = []
    engine = Engine(EngineConfig(model=args.model, task="generate", knobs=knobs)).start()
    try:
        telemetry = Telemetry(engine, window=args.window)
        phase(engine, telemetry, "light", args.seconds, 1, 32, 32, records)
        phase(engine, telemetry, "heavy", args.seconds, 8, 256, 64, records)
    finally:
        engine.shutdown(grace=0)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=0)


if __name__ == "__main__":
    main()
