"""The concurrency modes `selftune bench` compares, as server configs. Pure functions.

    multiprocess  N worker processes × 1 thread, requests tokenized inline (no pre/post pool)
    multithread   1 worker process × N threads, pre/post on a thread pool
    hybrid        processes × threads (N/2 × 2, at least 2 × 2) with the pool
    autotuned     the default policy, starting from the seed defaults (4 × 2, 0.1 s, batch 32)
    default       `selftune serve` with no options: the shipped config, N × 1, the default policy on
    oracle        the best static configuration a sweep found (filled in by the runner)
    static:KNOBS  any fixed knobs, e.g. static:process_count=2,max_batch_size=32
    autotuned:KNOBS  the policy starting from these knobs instead of the seed defaults
    MODE@SERVED   any of these serving SERVED instead of what model.dtype/backend auto choose:
                  float32, bfloat16 (torch), torch (auto dtype, torch only) or onnxruntime

N is the number of usable cores. The fixed modes keep the shipped batching knobs
(configs/default.yaml: batch 16, timeout 5 ms): what a user gets without tuning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import Knobs

SEED_DEFAULTS = Knobs(process_count=4, threads_per_process=2, io_threads=2, batch_timeout=0.1, max_batch_size=32)
"""Where a new user plausibly starts: what `autotuned` starts from (issue 5's seed A)."""

SHIPPED = Knobs()
"""The shipped batching knobs (configs/default.yaml) that the fixed modes keep."""

STANDARD_MODES = ("multiprocess", "multithread", "hybrid", "autotuned", "oracle")

SERVED = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "torch": (None, "torch"), "onnxruntime": (None, "onnxruntime")}
"""`MODE@SERVED`: (model.dtype, model.backend) for each; a named dtype serves torch (engine.embedding.decide_backend)."""


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    knobs: Knobs
    autotune: bool = False
    allow_oversubscription: bool = False
    description: str = ""
    dtype: str | None = None
    """model.dtype for its server; None leaves the config's default (auto)."""
    backend: str | None = None
    """model.backend for its server; None leaves the config's default (auto)."""
    shipped_batch_tokens: bool = False
    """Its server keeps the shipped `max_batch_tokens: auto` (generation on a CPU: measured at
    start-up) instead of knobs.max_batch_tokens."""
    queue_timeout: float | None = None
    """limits.queue_timeout_seconds for its server (`selftune bench --queue-timeout`); None: off."""

    def server_config(self, model: str, policy: str | None = None, task: str = "embed") -> dict:
        """The `selftune serve` config for this mode (`task` generate: max_batch_size is running sequences per worker)."""
        served = {key: value for key, value in (("dtype", self.dtype), ("backend", self.backend)) if value}
        config = {
            "model": {"name": model, "task": task, **served},
            "concurrency": {**dataclasses.asdict(self.knobs), **({"max_batch_tokens": "auto"} if self.shipped_batch_tokens else {})},
            "server": {"log_level": "warning"},
            "autotune": {"enabled": self.autotune, "allow_oversubscription": self.allow_oversubscription},
            # the static modes keep exactly these knobs, oversubscribed or not
            "bounds": {"process_count": {"min": 1, "max": 64}, "threads_per_process": {"min": 1, "max": 64}},
        }
        if self.queue_timeout is not None:
            config["limits"] = {"queue_timeout_seconds": self.queue_timeout}
        if policy is not None and self.autotune:
            config["autotune"]["policy"] = policy
        return config


def parse_knobs(text: str, base: Knobs = Knobs()) -> Knobs:
    """`process_count=2,max_batch_size=8,batch_timeout=0.005` -> Knobs (others from `base`)."""
    changes = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in Knobs.__dataclass_fields__:
            raise ValueError(f"unknown knob {name!r}; one of {', '.join(Knobs.__dataclass_fields__)}")
        changes[name] = float(value) if name == "batch_timeout" else int(value)
    return base.replace(**changes)


def mode(name: str, cores: int) -> Mode:
    """The Mode called `name` on a machine with `cores` usable cores (not `oracle`: see the runner)."""
    n = max(1, cores)
    base, at, served = name.partition("@")
    if at:
        if served not in SERVED:
            raise ValueError(f"mode {name!r}: after @ one of {', '.join(SERVED)}")
        dtype, backend = SERVED[served]
        inner = mode(base, cores)
        return dataclasses.replace(inner, name=name, dtype=dtype, backend=backend)  # the table names what its server served
    if name == "default":
        return Mode(name, SHIPPED.replace(process_count=n), autotune=True, description=f"the shipped config ({n} × 1), default policy", shipped_batch_tokens=True)
    if name == "multiprocess":
        return Mode(name, SHIPPED.replace(process_count=n, threads_per_process=1, io_threads=0), description=f"{n} × 1, inline pre/post", shipped_batch_tokens=True)
    if name == "multithread":
        return Mode(name, SHIPPED.replace(process_count=1, threads_per_process=n, io_threads=2), description=f"1 × {n}, pre/post pool of 2",
                    shipped_batch_tokens=True)
    if name == "hybrid":
        processes = max(2, n // 2)
        threads = max(2, n // processes)
        over = processes * threads > n
        note = f"{processes} × {threads}, pre/post pool of 2" + (f" (oversubscribes {n} cores)" if over else "")
        return Mode(name, SHIPPED.replace(process_count=processes, threads_per_process=threads, io_threads=2), allow_oversubscription=over, description=note,
                    shipped_batch_tokens=True)
    if name == "autotuned":
        return Mode(name, SEED_DEFAULTS, autotune=True, description="default policy from 4 × 2, 0.1 s, batch 32")
    kind, _, knobs = name.partition(":")
    if kind == "static" and knobs:
        k = parse_knobs(knobs, SHIPPED)
        shipped = "max_batch_tokens" not in knobs  # a knob not named is the shipped config's
        return Mode(name, k, allow_oversubscription=k.process_count * k.threads_per_process > n, description=describe(k), shipped_batch_tokens=shipped)
    if kind == "autotuned" and knobs:
        k = parse_knobs(knobs, SEED_DEFAULTS)
        return Mode(name, k, autotune=True, description="default policy from " + describe(k))
    raise ValueError(f"unknown mode {name!r}; one of {', '.join(STANDARD_MODES)}, default, static:KNOBS, autotuned:KNOBS, MODE@SERVED")


def describe(k: Knobs) -> str:
    chunk = "" if k.max_batch_tokens == SHIPPED.max_batch_tokens else f", {k.max_batch_tokens} prompt tokens/step"
    return f"{k.process_count} × {k.threads_per_process}, batch {k.max_batch_size}, timeout {k.batch_timeout * 1000:g} ms, io {k.io_threads}{chunk}"


def oracle_candidates(cores: int, quick: bool) -> list[Knobs]:
    """The static grid the oracle sweep tries: the two layouts that fill the cores (each with its
    fixed mode's pre/post setting) × batching knobs, the fixed modes' own batching included."""
    n = max(1, cores)
    layouts = {(n, 1, 0), (1, n, 2)}
    batches = (16, 64) if quick else (16, 32, 64)
    timeouts = (SHIPPED.batch_timeout,) if quick else (0.002, SHIPPED.batch_timeout, 0.02)
    return [
        SHIPPED.replace(process_count=p, threads_per_process=t, io_threads=io, max_batch_size=b, batch_timeout=w)
        for p, t, io in sorted(layouts)
        for b in batches
        for w in timeouts
    ]


def generation_candidates(cores: int, quick: bool) -> list[Knobs]:
    """The oracle's static grid for generation: the two layouts that fill the cores × running
    sequences per worker (max_batch_size; the batch timeout does not apply to decode steps) ×
    prompt tokens per step (max_batch_tokens: a small chunk keeps ITL, a large one TTFT)."""
    n = max(1, cores)
    layouts = {(n, 1, 0), (1, n, 2)}
    batches = (8, 32) if quick else (8, 16, 32, 64)
    chunks = (32, 256)
    return [SHIPPED.replace(process_count=p, threads_per_process=t, io_threads=io, max_batch_size=b, max_batch_tokens=c)
            for p, t, io in sorted(layouts) for b in batches for c in chunks]


def parse_grid(text: str, cores: int, base: Knobs = SHIPPED) -> list[Knobs]:
    """`process_count=1,2;max_batch_size=4,16` -> every combination (others from `base`) that fits the cores."""
    import itertools

    axes: dict[str, list] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, values = part.partition("=")
        name = name.strip()
        if not sep or name not in Knobs.__dataclass_fields__:
            raise ValueError(f"--grid: {part!r} is not KNOB=V1,V2,... with a knob from {', '.join(Knobs.__dataclass_fields__)}")
        cast = float if name == "batch_timeout" else int
        axes[name] = [cast(v) for v in values.split(",") if v.strip()]
    combos = [base.replace(**dict(zip(axes, values))) for values in itertools.product(*axes.values())]
    fitting = [k for k in combos if k.process_count * k.threads_per_process <= max(1, cores)]
    if not fitting:
        raise ValueError(f"--grid: no combination fits {cores} cores")
    return fitting
