"""Arrival generators for the simulator: pure functions of their parameters and a seed.

Each returns a list of (arrival_time, input_tokens), sorted by time, starting near 0. One
request is one input (one embedding item). The same seed gives the same arrivals, so policies
and knob settings are compared on exactly the same traffic.

Specs (for the command line and tune configs): a mapping {kind: ..., params} or the compact
string `kind:key=value,key=value`, e.g.

    poisson:rate=5,duration=60,length=16
    step:schedule=2x60+8x60+2x60,length=16-128
    onoff:on_rate=20,off_rate=1,on_seconds=10,off_seconds=30,duration=300
    mmpp:rates=2/15,mean_seconds=20/5,duration=600
    diurnal:mean_rate=5,amplitude=0.8,period=600,duration=1200
    trace:path=../shared/traces/azure_llm_conv_2023.csv,speed=2,start=0,duration=600
"""

from __future__ import annotations

import os

import math
from typing import Iterable

import numpy as np

Arrivals = list[tuple[float, int]]
MAX_TOKENS = 512
"""MiniLM's limit: longer inputs are clipped to it."""


def _lengths(rng: np.random.Generator, n: int, length) -> np.ndarray:
    """Fixed length (int) or uniform over an inclusive (low, high) range."""
    if isinstance(length, (tuple, list)):
        return rng.integers(int(length[0]), int(length[1]) + 1, size=n)
    return np.full(n, int(length))


def _pack(times: np.ndarray, lengths: np.ndarray) -> Arrivals:
    order = np.argsort(times, kind="stable")
    return list(zip(times[order].tolist(), lengths[order].astype(int).tolist()))


def poisson(rate: float, duration: float, length=16, seed: int = 0) -> Arrivals:
    """Exponential inter-arrival times at `rate` per second, for `duration` seconds."""
    return piecewise([(rate, duration)], length, seed)


def step(schedule: Iterable[tuple[float, float]], length=16, seed: int = 0) -> Arrivals:
    """Poisson at each (rate, seconds) of the schedule in turn."""
    return piecewise(list(schedule), length, seed)


def piecewise(schedule: list[tuple[float, float]], length=16, seed: int = 0) -> Arrivals:
    """Poisson with a rate constant over consecutive segments (the building block of the others)."""
    rng = np.random.default_rng(seed)
    chunks, start = [], 0.0
    for rate, seconds in schedule:
        if rate > 0 and seconds > 0:
            n = rng.poisson(rate * seconds)
            chunks.append(start + np.sort(rng.uniform(0.0, seconds, size=n)))
        start += seconds
    times = np.concatenate(chunks) if chunks else np.zeros(0)
    return _pack(times, _lengths(rng, len(times), length))


def onoff(on_rate: float, off_rate: float, on_seconds: float, off_seconds: float, duration: float, length=16, seed: int = 0) -> Arrivals:
    """Bursty: alternating on and off periods of fixed length, Poisson within each."""
    schedule, t, on = [], 0.0, True
    while t < duration:
        seconds = min(on_seconds if on else off_seconds, duration - t)
        schedule.append((on_rate if on else off_rate, seconds))
        t, on = t + seconds, not on
    return piecewise(schedule, length, seed)


def mmpp(rates: list[float], mean_seconds: list[float], duration: float, length=16, seed: int = 0) -> Arrivals:
    """Markov-modulated Poisson: states with their rates, exponential sojourns, next state uniform among the others."""
    rng = np.random.default_rng(seed + 1_000_003)
    schedule, t, state = [], 0.0, 0
    while t < duration:
        seconds = min(rng.exponential(mean_seconds[state]), duration - t)
        schedule.append((rates[state], seconds))
        t += seconds
        if len(rates) > 1:
            state = int(rng.choice([s for s in range(len(rates)) if s != state]))
    return piecewise(schedule, length, seed)


def diurnal(mean_rate: float, amplitude: float, period: float, duration: float, length=16, seed: int = 0) -> Arrivals:
    """Sinusoidal rate mean × (1 + amplitude·sin(2πt/period)), by thinning a Poisson process."""
    rng = np.random.default_rng(seed)
    peak = mean_rate * (1 + abs(amplitude))
    n = rng.poisson(peak * duration)
    times = np.sort(rng.uniform(0.0, duration, size=n))
    rate = mean_rate * (1 + amplitude * np.sin(2 * math.pi * times / period))
    kept = times[rng.uniform(0.0, peak, size=n) < rate]
    return _pack(kept, _lengths(rng, len(kept), length))


def read_trace(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(seconds since the first arrival, ContextTokens) from an Azure LLM trace CSV.

    TIMESTAMP is `YYYY-MM-DD HH:MM:SS.fffffff` (7 fractional digits, more than datetime takes);
    CRLF line endings and a missing final newline are both fine.
    """
    times, tokens = [], []
    with open(path, encoding="utf-8", newline="") as f:
        header = f.readline().strip().split(",")
        t_col, c_col = header.index("TIMESTAMP"), header.index("ContextTokens")
        for line in f:
            line = line.strip()
            if not line:
                continue
            cells = line.split(",")
            times.append(_seconds_of_day(cells[t_col]))
            tokens.append(int(cells[c_col]))
    t = np.asarray(times, float)
    order = np.argsort(t, kind="stable")
    t = t[order]
    return t - t[0], np.asarray(tokens, int)[order]


def _seconds_of_day(stamp: str) -> float:
    """Seconds since the epoch day of `stamp` (dates count too, so traces may cross midnight)."""
    date, clock = stamp.strip().split(" ")
    year, month, day = (int(x) for x in date.split("-"))
    hours, minutes, seconds = clock.split(":")
    days = _days_from_civil(year, month, day)
    return days * 86400.0 + int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _days_from_civil(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 (Howard Hinnant's algorithm), without datetime's 6-digit fraction limit."""
    y -= m <= 2
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def trace(path: str, speed: float = 1.0, start: float = 0.0, duration: float | None = None, max_tokens: int = MAX_TOKENS, min_tokens: int = 1) -> Arrivals:
    """Replay a trace: the part [start, start + duration) of its own time, `speed` × faster,
    input lengths (ContextTokens) clipped to [min_tokens, max_tokens]. A relative path that
    is not found from the current directory is taken from the project's directory (so
    `../shared/traces/...` works from anywhere)."""
    t, tokens = read_trace(_locate(path))
    end = np.inf if duration is None else start + duration
    sel = (t >= start) & (t < end)
    times = (t[sel] - start) / speed
    return _pack(times, np.clip(tokens[sel], min_tokens, max_tokens))


def _locate(path: str) -> str:
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(project, path)


GENERATORS = {"poisson": poisson, "step": step, "onoff": onoff, "mmpp": mmpp, "diurnal": diurnal, "trace": trace}


def from_spec(spec) -> Arrivals:
    """Build arrivals from a mapping {kind, ...} or a compact `kind:key=value,...` string."""
    if isinstance(spec, str):
        spec = parse_spec(spec)
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in GENERATORS:
        raise ValueError(f"workload kind {kind!r}: expected one of {', '.join(GENERATORS)}")
    if "length" in spec:
        spec["length"] = _length_value(spec["length"])
    if kind == "step":
        spec["schedule"] = _schedule_value(spec["schedule"])
    for key in ("rates", "mean_seconds"):
        if isinstance(spec.get(key), str):
            spec[key] = [float(x) for x in spec[key].split("/")]
    try:
        return GENERATORS[kind](**spec)
    except TypeError as exc:
        raise ValueError(f"workload {kind}: {exc}") from None


def parse_spec(text: str) -> dict:
    """`poisson:rate=5,duration=60` -> {'kind': 'poisson', 'rate': 5.0, 'duration': 60.0}."""
    kind, _, rest = text.partition(":")
    spec: dict = {"kind": kind.strip()}
    for part in filter(None, rest.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"workload {text!r}: expected key=value, got {part!r}")
        spec[key.strip()] = _number(value.strip())
    return spec


def _number(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _length_value(value):
    if isinstance(value, str) and "-" in value:
        low, high = value.split("-")
        return (int(low), int(high))
    return value


def _schedule_value(value) -> list[tuple[float, float]]:
    """`2x60+8x60` or [[2, 60], [8, 60]] -> [(2.0, 60.0), (8.0, 60.0)]."""
    if isinstance(value, str):
        return [tuple(float(x) for x in seg.split("x")) for seg in value.split("+")]
    return [(float(r), float(s)) for r, s in value]
