"""The closed set of messages between the front process, the zygote and the workers.

Small frozen dataclasses sent over Unix-socket connections. Tensors never travel here: token
ids and embeddings go through each worker's shared-memory slots (engine/shm.py); a message
only says which slot holds what.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import Task
from engine.sampling import SamplingParams, TokenLogprobs

# ---- front -> zygote ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a freshly forked worker needs to know."""

    worker_id: int
    task: Task
    device: str
    threads: int
    max_batch_size: int
    slots: int
    """Shared-memory slots for embedding batches (how many batches it may hold)."""
    slot_items: int
    """Items per slot: the max_batch_size bound, so a live knob change never outgrows it."""
    max_length: int
    hidden_size: int
    eos_token_ids: tuple[int, ...] = ()
    warmup: bool = True
    pack_row_tokens: int = 0
    """Embeddings: pack mixed-length batches into rows of this many tokens (0: padded)."""
    vocab_size: int = 0
    cpus: tuple[int, ...] = ()
    """CPUs to pin to (empty: leave the affinity alone)."""
    numa_node: int | None = None
    """NUMA node to bind memory to, when all its CPUs sit on one."""
    kv_tokens: int | None = None
    """Generation: the ceiling of its KV cache's token slots (model.kv_cache_mib); None: none."""
    kv_knob: int = 0
    """Generation: the kv_tokens knob, the live cap under that ceiling (0: the ceiling)."""
    max_batch_tokens: int = 0
    """Generation: most prompt tokens one step prefills (0: whole prompts)."""


@dataclass(frozen=True, slots=True)
class Fork:
    spec: WorkerSpec


@dataclass(frozen=True, slots=True)
class ZygoteLoaded:
    """The zygote has imported everything and loaded the weights; it can fork workers now."""

    device: str
    dtype: str
    dtype_choice: dict | None = None
    """How model.dtype was resolved: requested, dtype, mode, reason, native_bf16, min_cosine
    (worst cosine to fp32 on the probe set), bf16_speedup... (for /stats, /metrics, the log)."""
    batch_tokens_choice: dict | None = None
    """`max_batch_tokens: auto` measured on a CPU (engine.gen_chunk): per_thread, reason, the
    probe's step times; None when the knob was set or not measured here."""


@dataclass(frozen=True, slots=True)
class ZygoteFailed:
    error: str


@dataclass(frozen=True, slots=True)
class Forked:
    """A worker exists; the front end of its socket follows this message as a passed fd."""

    worker_id: int
    pid: int


# ---- front -> worker ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunEmbed:
    batch_id: int
    slot: int
    lengths: tuple[int, ...]
    """Real length of each row; the ids are padded to max(lengths) in the slot."""


@dataclass(frozen=True, slots=True)
class AddSequence:
    seq_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AbortSequence:
    seq_id: int


@dataclass(frozen=True, slots=True)
class SetKnobs:
    """Live changes a worker applies between batches or decode steps."""

    threads: int
    max_batch_size: int
    cpus: tuple[int, ...] = ()
    """Re-pin to these CPUs (empty: leave the affinity alone)."""
    max_batch_tokens: int = 0
    """Generation: most prompt tokens one step prefills (0: whole prompts)."""
    kv_tokens: int = 0
    """Generation: the KV cap under the worker's ceiling (0: the ceiling); a lower cap preempts
    the youngest rows at the next step, and they are recomputed later."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish nothing more: the front only sends it once the worker holds no work."""


# ---- worker -> front ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a worker; its shared-memory fd follows as a passed fd."""

    worker_id: int
    pid: int
    shm_bytes: int


@dataclass(frozen=True, slots=True)
class Ready:
    warmup_seconds: float


@dataclass(frozen=True, slots=True)
class EmbedDone:
    batch_id: int
    slot: int
    model_seconds: float


@dataclass(frozen=True, slots=True)
class GenerationLoad:
    """A generation worker's state after a step: what /stats and /metrics show per worker."""

    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    """0: no cap."""
    preemptions: int = 0
    """Since the worker started."""
    max_running: int = 0
    """The live settings it runs with: running sequences, prompt tokens per step (0: whole)."""
    max_batch_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Tokens:
    """Tokens produced by one decode step: (seq_id, token_id, finish_reason or None, logprobs or None)."""

    outputs: tuple[tuple[int, int, str | None, TokenLogprobs | None], ...]
    model_seconds: float
    load: GenerationLoad = GenerationLoad()


@dataclass(frozen=True, slots=True)
class WorkFailed:
    """The model raised on this work (e.g. bad input); the worker itself is fine."""

    key: int
    error: str
    sequences: tuple[int, ...] = field(default=())
