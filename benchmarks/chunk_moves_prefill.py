"""Did a prefill chunk grown for TTFT prefill more? Read off finished `selftune bench --task generate` replays.

    python benchmarks/chunk_moves_prefill.py OUT_DIR [OUT_DIR ...] [--window 10]

For each bench output folder (bench.json and requests.csv of an autotuned replay) and each chunk
growth the policy made for TTFT, the prompt tokens whose first token came in the `--window` seconds
before the move and in the `--window` seconds after it (from one second on): the prefill the
workers got through, as the clients saw it. The decisions are on the run log's clock and the
requests on the replay's; the offset between the two (the warm-up) is the shift that best matches
the requests in flight to the running sequences the bench polled from /stats.
"""

from __future__ import annotations

import argparse
import csv
import json
import os

import numpy as np


def clock_offset(requests: list[dict], timeline: list[dict]) -> float:
    """Seconds to add to a request's sent_at to put it on the decisions' clock."""
    sent = np.array([float(r["sent_at"]) for r in requests])
    done = sent + np.array([float(r["latency"]) for r in requests])
    polls = [(p["t"], p["running"]) for p in timeline[::5] if "running" in p]

    def mismatch(offset: float) -> float:
        return sum((int(((sent <= t - offset) & (t - offset < done)).sum()) - running) ** 2 for t, running in polls if t > offset)

    return min(np.arange(0.0, 15.0, 0.25), key=mismatch)


def chunk_moves(folder: str, window: float) -> list[str]:
    with open(os.path.join(folder, "bench.json")) as f:
        mode = next(m for m in json.load(f)["modes"] if m.get("decisions"))
    with open(os.path.join(folder, "requests.csv")) as f:
        ok = [r for r in csv.DictReader(f) if r["mode"] == mode["mode"] and r["status"] == "200" and r["ttft"]]
    offset = clock_offset(ok, mode["timeline"])
    first = np.array([float(r["sent_at"]) + float(r["ttft"]) + offset for r in ok])
    prompts = np.array([int(r["prompt_tokens"] or 0) for r in ok])  # empty: the server reported no usage (a cut stream)
    lines = [f"{folder}: replay clock + {offset:.2f} s = the decisions' clock"]
    for d in mode["decisions"]:
        old, new = d["old"]["max_batch_tokens"], d["new"]["max_batch_tokens"]
        if d["outcome"] != "applied" or not new > old or "TTFT over" not in d["reason"]:
            continue
        t = d["at"]
        before = prompts[(first >= t - window) & (first < t)].sum() / window
        after = prompts[(first >= t + 1) & (first < t + 1 + window)].sum() / window
        lines.append(f"  {t:7.1f} s  {old} -> {new}: {before:5.0f} prompt tokens/s first-tokened before, {after:5.0f} after ({after / max(before, 1):.2f} ×)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="selftune bench --out folders of autotuned replays")
    parser.add_argument("--window", type=float, default=10.0, help="seconds before and after each move")
    args = parser.parse_args()
    for folder in args.folders:
        print("\n".join(chunk_moves(folder, args.window)))


if __name__ == "__main__":
    main()
