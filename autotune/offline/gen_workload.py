"""Generation workloads for the simulator: (arrival seconds, prompt tokens, output tokens).

A trace (`trace:path=...,start=,duration=,speed=`) takes both lengths from its ContextTokens and
GeneratedTokens columns (the Azure LLM traces); any other workload kind takes its arrivals and
prompt lengths from autotune/bench/workloads.py and `output=N` tokens each (64 by default).
Lengths are clipped to the model's context: the prompt to max_positions - 1, the output to what
is left of it.
"""

from __future__ import annotations

import csv
import datetime

from autotune.bench.workloads import _locate, from_spec, parse_spec

DEFAULT_OUTPUT = 64


def generation_arrivals(spec, max_positions: int) -> list[tuple[float, int, int]]:
    spec = dict(parse_spec(spec) if isinstance(spec, str) else spec)
    if spec.get("kind") == "trace":
        rows = _trace(spec)
    else:
        output = int(spec.pop("output", DEFAULT_OUTPUT))
        rows = [(float(t), int(n), output) for t, n in from_spec(spec)]
    out = []
    for t, prompt, output in rows:
        prompt = min(max(prompt, 1), max_positions - 1)
        out.append((t, prompt, min(max(output, 1), max_positions - prompt)))
    return out


def _trace(spec: dict) -> list[tuple[float, int, int]]:
    """The part [start, start + duration) of the trace's own time, `speed` × faster."""
    start, speed = float(spec.get("start", 0.0)), float(spec.get("speed", 1.0))
    duration = spec.get("duration")
    with open(_locate(spec["path"]), encoding="utf-8", newline="") as f:
        rows = [(_seconds(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rows.sort(key=lambda r: r[0])
    first = rows[0][0] if rows else 0.0
    end = float("inf") if duration is None else start + float(duration)
    return [((t - first - start) / speed, c, g) for t, c, g in rows if start <= t - first < end]


def _seconds(stamp: str) -> float:
    """`YYYY-MM-DD HH:MM:SS.fffffff` (seven fractional digits: more than datetime parses) -> seconds."""
    day, clock = stamp.strip().split(" ")
    hours, minutes, seconds = clock.split(":")
    return datetime.date.fromisoformat(day).toordinal() * 86400.0 + int(hours) * 3600 + int(minutes) * 60 + float(seconds)
