"""Cost models: how long one embedding batch takes, as a function of the batch and the machine.

The simulator asks a cost model for every batch's service time. A fitted model comes from
`selftune profile` (real forward passes on this machine); a deterministic one is for tests.
A fitted model states the backend and dtype it was measured with (`backend`); `check_dtype`
holds it against the model.dtype being simulated (bf16 runs MiniLM 1.5-2x faster than fp32).

The fitted form is physically motivated rather than a free-form regression, so it
extrapolates sensibly past the profiled grid:

    t = (a + b·B·L + c·B·L²) / speedup(threads) × contention + o·max(0, u - 1)

    work          a: fixed per-batch overhead; b·B·L: the linear layers (per token);
                  c·B·L²: attention (per token pair).
    speedup       Amdahl: 1 / ((1 - f) + f / threads), f the parallel fraction.
    contention    1 + s·min(others, cores)/cores + k·max(0, u - 1)
                  others = threads of the *other* busy workers (shared memory bus and caches),
                  u = all busy threads / cores (over 1: the OS time-slices the cores).
    o             oversubscribed OpenMP pools stall at every barrier, waiting for a thread
                  the OS has descheduled: a cost per batch (per layer), not per token, so it
                  is a separate additive term (measured here: 2 × 2 threads on 2 cores turns
                  a 6 ms batch into 300 ms).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

COEFFICIENTS = ("a", "b", "c", "f", "s", "k", "o")
FORM = "(a + b*B*L + c*B*L^2) / (1/((1-f) + f/threads)) * (1 + s*min(others,cores)/cores + k*max(0, busy_threads/cores - 1)) + o*max(0, busy_threads/cores - 1)"


class CostModel(Protocol):
    def service_time(self, batch_size: int, padded_length: int, threads: int, active_workers: int, cores: int) -> float:
        """Seconds one batch takes; `active_workers` counts the busy workers including this one."""
        ...


@dataclass(frozen=True, slots=True)
class DeterministicCostModel:
    """Every batch takes exactly `seconds`: queueing theory's M/D/1 server, for tests."""

    seconds: float

    def service_time(self, batch_size: int, padded_length: int, threads: int, active_workers: int, cores: int) -> float:
        return self.seconds


@dataclass(frozen=True, slots=True)
class FittedCostModel:
    """The fitted form of the module docstring, with the machine it was measured on."""

    a: float
    b: float
    c: float
    f: float = 1.0
    s: float = 0.0
    k: float = 1.0
    o: float = 0.0
    machine: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)
    """How good the fit is: held-out errors, point counts."""
    points: list = field(default_factory=list)
    """The measurements it was fitted to (batch_size, padded_length, threads, processes, seconds)."""
    serving: dict = field(default_factory=dict)
    """Per-request costs outside the workers, measured on a live server by `selftune validate
    --calibrate`: request_overhead_seconds and model_time_factor (the simulator's defaults), and
    front_cpu_seconds_per_request (reported; the busy model_time_factor already carries it)."""
    backend: dict = field(default_factory=dict)
    """What the forward passes ran as: name (torch), dtype (float32, bfloat16: mixed), mode, and
    the model.dtype the profile was asked for (`requested`: auto, or a forced dtype)."""

    def service_time(self, batch_size: int, padded_length: int, threads: int, active_workers: int, cores: int) -> float:
        return float(
            predict(
                self.coefficients(),
                np.array([batch_size], float),
                np.array([padded_length], float),
                np.array([threads], float),
                np.array([active_workers], float),
                float(cores),
            )[0]
        )

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in COEFFICIENTS], float)

    def to_json(self) -> dict:
        return {"form": FORM, "coefficients": {n: getattr(self, n) for n in COEFFICIENTS}, "backend": self.backend, "machine": self.machine,
                "fit": self.fit, "serving": self.serving, "points": self.points}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_json(cls, data: dict) -> "FittedCostModel":
        coefficients = data["coefficients"]
        return cls(
            **{n: float(coefficients[n]) for n in COEFFICIENTS},
            machine=data.get("machine", {}),
            fit=data.get("fit", {}),
            points=data.get("points", []),
            serving=data.get("serving", {}),
            # files from before the backend was recorded: the profiler wrote the dtype it was given into `machine`
            backend=data.get("backend") or ({"name": "torch", "dtype": data["machine"]["dtype"]} if "dtype" in data.get("machine", {}) else {}),
        )


def load_cost_model(path: str) -> FittedCostModel:
    with open(path, encoding="utf-8") as f:
        model = FittedCostModel.from_json(json.load(f))
    for name in SPREADS:
        try:
            check_percentiles(name, model.serving.get(name, ()))
        except ValueError as exc:
            raise ValueError(f"{path}: serving.{exc}") from None
    return model


DTYPES = ("auto", "float32", "bfloat16", "float16")
"""model.dtype's values (autotune/settings.py)."""


def check_dtype(model: "FittedCostModel", requested: str, native_bf16: tuple[bool, str] | None, source: str = "the cost model") -> str | None:
    """Whether `model` was measured with the dtype a server with `model.dtype: requested` serves:
    ValueError when it certainly was not, a warning (returned) when it may not have been, None
    when it was. `native_bf16` is engine.loading.native_bf16 on the simulated CPU (for auto)."""
    if requested not in DTYPES:
        raise ValueError(f"model.dtype: {requested!r}: expected one of {', '.join(DTYPES)}")
    measured = model.backend.get("dtype")
    if measured is None:
        return f"{source} does not say which dtype it was measured with; model.dtype is {requested}"
    hint = f"profile with `selftune profile --dtype {requested}`"
    if requested != "auto":
        if measured != requested:
            raise ValueError(f"{source} was measured with dtype {measured}, but model.dtype is {requested}: {hint}, or simulate --dtype {measured}")
        return None
    if model.backend.get("requested") == "auto":
        return None  # profiled the way the server chooses: the choice it measured is auto's on that machine
    if native_bf16 is not None and not native_bf16[0]:
        if measured != "float32":  # without native bf16, auto always serves fp32
            raise ValueError(f"{source} was measured with dtype {measured}, but model.dtype auto serves float32 on this CPU ({native_bf16[1]}): {hint}")
        return None
    if measured == "float32":
        return (f"{source} was measured in float32, but model.dtype auto serves bfloat16 on a CPU with native bf16 where it holds "
                f"fidelity and measures faster (1.5-2x for MiniLM): simulated batches take fp32's time; {hint}, or simulate --dtype float32")
    return None


SPREADS = ("request_overhead_percentiles", "model_time_percentiles")
"""Serving distributions, as percentiles 0, 1, ..., 100 (`validate --calibrate` measures them)."""


def check_percentiles(name: str, values) -> None:
    """Empty, or 101 finite non-decreasing numbers (percentiles 0..100): the simulator draws from them."""
    values = list(values)
    if values and (len(values) != 101 or not all(math.isfinite(v) for v in values) or any(b < a for a, b in zip(values, values[1:]))):
        raise ValueError(f"{name}: expected 101 finite non-decreasing values (percentiles 0..100), got {len(values)} values")


def predict(theta: np.ndarray, B, L, threads, workers, cores: float) -> np.ndarray:
    """The form, vectorised over points; `workers` busy at once (each with `threads`)."""
    a, b, c, f, s, k, o = theta
    work = a + b * B * L + c * B * L * L
    speedup = 1.0 / ((1.0 - f) + f / threads)
    others = (workers - 1) * threads
    busy = workers * threads / cores
    contention = 1.0 + s * np.minimum(others, cores) / cores + k * np.maximum(0.0, busy - 1.0)
    return work / speedup * contention + o * np.maximum(0.0, busy - 1.0)


@dataclass(frozen=True, slots=True)
class Point:
    """One measurement: `processes` workers each running (batch_size, padded_length) with `threads`."""

    batch_size: int
    padded_length: int
    threads: int
    processes: int
    seconds: float


def fit(points: list[Point], cores: int) -> np.ndarray:
    """Robust least squares on relative error (log residuals), coefficients >= 0, f in [0, 1].

    soft-L1 loss: a point measured while something else held a core can be off several-fold,
    and plain squares would bend the whole fit toward it."""
    from scipy.optimize import least_squares

    B, L, T, P, y = _columns(points)
    scale = np.array([np.min(y), np.median(y / (B * L)), np.median(y / (B * L * L)), 1, 1, 1, np.median(y)])

    def residuals(x):
        return np.log(predict(x * scale, B, L, T, P, float(cores))) - np.log(y)

    upper = np.array([np.inf, np.inf, np.inf, 1.0, np.inf, np.inf, np.inf])
    best = None
    for x0 in _starts():  # a few starts: the log residuals are not convex in (f, s, k, o)
        result = least_squares(residuals, x0, bounds=(np.full(7, 1e-12), upper), x_scale="jac", max_nfev=5000, loss="soft_l1", f_scale=0.1)
        if best is None or result.cost < best.cost:
            best = result
    return best.x * scale


def _starts() -> list[np.ndarray]:
    """Starting points in scaled units: (a, b, c) near the data, (f, s, k, o) over their ranges."""
    return [
        np.array([0.5, 0.5, 0.5, f, s, k, o])
        for f, s, k, o in ((0.9, 0.1, 1.0, 0.5), (0.5, 0.5, 0.1, 0.01), (0.95, 0.01, 0.01, 1.0), (0.7, 1.0, 3.0, 0.1))
    ]


def relative_errors(theta: np.ndarray, points: list[Point], cores: int) -> np.ndarray:
    B, L, T, P, y = _columns(points)
    return np.abs(predict(theta, B, L, T, P, float(cores)) - y) / y


def split_heldout(points: list[Point], fraction: float = 0.25, seed: int = 0) -> tuple[list[Point], list[Point]]:
    """A seeded split of the grid into fitting and held-out points."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(points))
    held = max(1, int(round(len(points) * fraction)))
    heldout = {int(i) for i in order[:held]}
    return [p for i, p in enumerate(points) if i not in heldout], [p for i, p in enumerate(points) if i in heldout]


def fit_cost_model(points: list[Point], cores: int, machine: dict | None = None, heldout_fraction: float = 0.25, seed: int = 0) -> FittedCostModel:
    """Fit on most of the grid, report the error on the rest (the saved model is the one scored)."""
    train, heldout = split_heldout(points, heldout_fraction, seed)
    theta = fit(train, cores)
    train_err = relative_errors(theta, train, cores)
    held_err = relative_errors(theta, heldout, cores)
    report = {
        "cores": cores,
        "train_points": len(train),
        "heldout_points": len(heldout),
        "train_mape": float(np.mean(train_err)),
        "heldout_mape": float(np.mean(held_err)),
        "heldout_median_ape": float(np.median(held_err)),
        "heldout_max_ape": float(np.max(held_err)),
        "heldout_seed": seed,
    }
    return FittedCostModel(*map(float, theta), machine=machine or {}, fit=report, points=[asdict(p) for p in points])


def _columns(points: list[Point]):
    arr = np.array([(p.batch_size, p.padded_length, p.threads, p.processes, p.seconds) for p in points], float)
    if len(arr) == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError("cost model points must be non-empty, finite and positive")
    return arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4]


def describe(model: CostModel) -> str:
    if isinstance(model, FittedCostModel):
        return f"fitted ({', '.join(f'{n}={getattr(model, n):.3g}' for n in COEFFICIENTS)})"
    return repr(model)

