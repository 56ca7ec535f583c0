"""The engine's configuration: the live knobs, their bounds, and the fixed settings.

`Knobs` is the single source of truth for everything the controller may change while the
engine serves; `EngineConfig` holds what is fixed for the engine's lifetime.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from engine import packing
from engine.placement import MachineTopology, PlacementMode

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cap(knob: int, ceiling: int | None) -> int | None:
    """A worker's KV cap: the kv_tokens knob within the ceiling model.kv_cache_mib sets (0: the
    ceiling); None: no cap at all."""
    if ceiling is None:
        return knob or None
    return min(knob, ceiling) if knob else ceiling


def kv_token_slots(kv_cache_mib: int, values_per_token: int, dtype: str) -> int | None:
    """How many tokens' keys and values fit in kv_cache_mib at dtype; None when unknown."""
    if values_per_token <= 0:
        return None
    return kv_cache_mib * 2**20 // (values_per_token * DTYPE_BYTES.get(dtype, 4))

Task = Literal["embed", "generate"]


class KnobError(ValueError):
    """A knob value outside its bounds; the message names the knob and what is allowed."""


CPU_BATCH_TOKENS_PER_THREAD = 32
"""`max_batch_tokens: auto` on a CPU, per worker thread, until the zygote has measured it
(engine.gen_chunk): 32 prompt tokens per thread keep a step that also decodes within a 250-ms
inter-token objective for a small model in fp32 (docs/BENCHMARKS.md, "One model call per step")."""
CUDA_BATCH_TOKENS = 2048
"""`max_batch_tokens: auto` on CUDA: a GPU step costs about the same for a few or thousands of tokens."""


def auto_batch_tokens(device: str, threads_per_process: int) -> int:
    """What `max_batch_tokens: auto` starts at: a step's prompt-token budget for this device."""
    if device.startswith("cuda"):
        return CUDA_BATCH_TOKENS
    return CPU_BATCH_TOKENS_PER_THREAD * max(1, threads_per_process)


@dataclass(frozen=True, slots=True)
class Knobs:
    """Concurrency settings that can change while the engine serves."""

    process_count: int = 1
    """Worker processes running the model."""
    threads_per_process: int = 1
    """torch intra-op threads in each worker."""
    io_threads: int = 2
    """Pre/post-processing threads (tokenization, response shaping) in the front process;
    0 runs that work inline on the caller's thread (the request's own thread or event loop)."""
    batch_timeout: float = 0.005
    """Seconds the batcher waits for a batch to fill before it sends what it has."""
    max_batch_size: int = 16
    """Items (embedding inputs) per batch, or running sequences per worker (generation)."""
    max_batch_tokens: int = 32
    """Generation: most prompt tokens one decode step prefills (the step's token budget); a
    longer prompt is prefilled in chunks while the running sequences keep decoding (0: whole
    prompts at once). The config file's default, `auto`, starts it at `auto_batch_tokens`; on a
    CPU the engine then starts its workers at what the zygote measured (engine.gen_chunk)."""
    kv_tokens: int = 0
    """Generation: token slots each worker's KV cache may hold, at most what model.kv_cache_mib
    holds (0: all of that). Lowered live, the youngest rows are preempted and recomputed."""

    def replace(self, **changes) -> "Knobs":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Bounds:
    """Allowed range of every knob; `validate` is the one place knob values are checked."""

    process_count: tuple[int, int] = (1, 16)
    threads_per_process: tuple[int, int] = (1, 64)
    io_threads: tuple[int, int] = (0, 32)
    batch_timeout: tuple[float, float] = (0.0, 1.0)
    max_batch_size: tuple[int, int] = (1, 256)
    max_batch_tokens: tuple[int, int] = (0, 65536)
    kv_tokens: tuple[int, int] = (0, 1 << 24)

    def validate(self, knobs: Knobs) -> Knobs:
        for f in dataclasses.fields(Knobs):
            value = getattr(knobs, f.name)
            lo, hi = getattr(self, f.name)
            kind = float if f.name == "batch_timeout" else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise KnobError(f"{f.name}: expected a number, got {value!r}")
            if kind is int and int(value) != value:
                raise KnobError(f"{f.name}: expected an integer, got {value!r}")
            if not lo <= value <= hi:
                raise KnobError(f"{f.name}={value!r} is outside the allowed range [{lo}, {hi}]")
        return knobs

    def clamp(self, knobs: Knobs) -> Knobs:
        changes = {}
        for f in dataclasses.fields(Knobs):
            lo, hi = getattr(self, f.name)
            changes[f.name] = min(max(getattr(knobs, f.name), lo), hi)
        return Knobs(**changes)


def default_cache_dir() -> str:
    """$SELFTUNE_CACHE, else ~/.cache/selftune."""
    return os.environ.get("SELFTUNE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "selftune"))


INFLIGHT_BATCHES = 1
"""One batch per worker: the next batch forms when a worker frees, from everything queued by
then, so it is fuller and packs better. Measured on 2 cores at 140 req/s of 10–50-token
inputs: p99 273 ms with one, 432 ms with two (the second batch formed early, half empty)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings fixed for the engine's lifetime."""

    model: str = "builtin:minilm"
    """A model directory, `builtin:minilm`, `builtin:smollm2`, or a hub name already cached."""
    task: Task = "embed"
    device: str = "auto"
    """`auto`, `cpu`, `cuda` or `cuda:N`."""
    dtype: str = "auto"
    """auto: embeddings measure bf16 against fp32 at start-up (engine.zygote); generation takes
    float32 on CPU, bf16 (or fp16) on CUDA. Or float32, bfloat16, float16 as named."""
    backend: str = "auto"
    """Embeddings: `auto` (torch, or ONNX Runtime where it measures faster at start-up and holds
    the fidelity bar; only with dtype auto), `torch`, or `onnxruntime` (fp32, CPU)."""
    kv_cache_mib: int = 1024
    """Generation: memory each worker's KV cache may hold (the ceiling of the kv_tokens knob);
    sequences wait (and the youngest are preempted) rather than pass it, and a request that
    could never fit is refused."""
    max_input_tokens: int | None = None
    """Longer inputs are rejected; None means the model's own limit."""
    pack_row_tokens: int = packing.DEFAULT_ROW_TOKENS
    """Embedding batches of mixed lengths run packed into rows of this many tokens (engine.packing);
    0 runs them padded."""
    knobs: Knobs = field(default_factory=Knobs)
    bounds: Bounds = field(default_factory=Bounds)
    measure_batch_tokens: bool = False
    """Generation on a CPU (`max_batch_tokens: auto`): the zygote measures the prompt chunk a step
    can prefill per thread (engine.gen_chunk) and knobs.max_batch_tokens starts at that ×
    threads_per_process instead of its value here."""
    warmup: bool = True
    """Run one dummy batch in each new worker before it takes traffic."""
    max_inflight_batches: int = INFLIGHT_BATCHES
    """Embedding batches a worker may hold at once."""
    queue_timeout: float | None = None
    """Seconds a request's work may wait in the front's queue for a worker; past it the request is
    refused (QueueTimeout, a 429) and never runs. None: it waits (until the request's own timeout)."""
    restart_backoff: tuple[float, float] = (0.1, 5.0)
    """Initial and maximum delay before a dead worker is replaced (doubles on each death)."""
    placement: PlacementMode = "auto"
    """`auto` (disjoint cores per worker, physical before SMT, NUMA-local), `none` (no
    pinning) or `explicit` (placement_cpus)."""
    placement_cpus: tuple[tuple[int, ...], ...] | None = None
    """With placement=explicit: one CPU list per worker."""
    workers_per_gpu: int = 1
    topology: MachineTopology | None = None
    """The CPUs and GPUs to place workers on; None: the CPUs of this process's affinity."""
    crash_loop: tuple[int, float] = (5, 60.0)
    """(deaths, seconds): that many unexpected worker deaths within that window is a crash
    loop: the engine stops replacing workers and reports itself not ready."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Where converted models (GGUF -> safetensors, ONNX exports) are kept."""
