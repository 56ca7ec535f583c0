"""The server's config file (YAML), validated with pydantic.

Every key is documented in configs/default.yaml and docs/CONFIG.md. A bad file is an error
that names the file, the key and what is allowed; nothing starts with a config it did not
understand.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autotune import shipped
from engine import packing
from engine.config import Bounds, EngineConfig, Knobs, auto_batch_tokens
from engine.http.state import ServerLimits

DEFAULT_CONFIG = shipped.builtin(shipped.CONFIG, "default")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSection(Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    shutdown_grace_seconds: Annotated[float, Field(ge=0, le=3600)] = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class ModelSection(Section):
    name: str = "builtin:minilm"
    task: Literal["embed", "generate"] = "embed"
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    backend: Literal["auto", "torch", "onnxruntime"] = "auto"
    max_input_tokens: Annotated[int, Field(ge=1)] | None = None
    kv_cache_mib: Annotated[int, Field(ge=1, le=1_048_576)] = 1024
    pack_row_tokens: Annotated[int, Field(ge=0, le=65536)] = packing.DEFAULT_ROW_TOKENS
    served_names: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(min_length=1, max_length=16)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, values):
        # The chunk became a live knob; say where it went rather than "unknown key".
        if isinstance(values, dict) and "prefill_chunk_tokens" in values:
            raise ValueError("prefill_chunk_tokens moved to concurrency.max_batch_tokens (a live knob now)")
        return values

    @model_validator(mode="after")
    def _onnx_runs_fp32_embeddings_on_cpu(self):
        if self.backend == "onnxruntime":
            if self.task != "embed":
                raise ValueError("backend: onnxruntime serves embeddings only (task: embed); use auto or torch for generate")
            if self.dtype not in ("auto", "float32"):
                raise ValueError(f"backend: onnxruntime runs float32; dtype: {self.dtype} needs backend: torch (or auto)")
            if self.device.startswith("cuda"):
                raise ValueError(f"backend: onnxruntime runs on the CPU here; device: {self.device} needs backend: torch (or auto)")
        return self


class ConcurrencySection(Section):
    process_count: Union[Annotated[int, Field(ge=1, le=1024)], Literal["auto"]] = "auto"
    threads_per_process: Annotated[int, Field(ge=1, le=1024)] = 1
    io_threads: Annotated[int, Field(ge=0, le=256)] = 2
    batch_timeout: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = 0.005
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = 16
    max_batch_tokens: Union[Annotated[int, Field(ge=0, le=1_048_576)], Literal["auto"]] = "auto"
    kv_tokens: Annotated[int, Field(ge=0, le=1 << 30)] = 0


class Range(Section):
    min: float
    max: float

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self


class BoundsSection(Section):
    process_count: Range | None = None
    threads_per_process: Range | None = None
    io_threads: Range | None = None
    batch_timeout: Range | None = None
    max_batch_size: Range | None = None
    max_batch_tokens: Range | None = None
    kv_tokens: Range | None = None


class LimitsSection(Section):
    max_items_per_request: Annotated[int, Field(ge=1, le=100_000)] = 256
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 4 * 1024 * 1024
    max_queued_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 512
    max_queued_tokens: Annotated[int, Field(ge=1)] | None = 200_000
    request_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 60.0
    queue_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] | None = None
    retry_after_seconds: Annotated[int, Field(ge=0, le=3600)] = 1
    default_max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 16


class PlacementSection(Section):
    mode: Literal["auto", "none", "explicit"] = "auto"
    """auto: disjoint cores per worker, physical cores before SMT siblings, inside one NUMA
    node when it fits, spread across nodes; none: no pinning; explicit: the lists in cpus."""
    cpus: list[list[Annotated[int, Field(ge=0)]]] | None = None
    """With mode explicit: one CPU list per worker (process_count is then fixed to their number)."""
    workers_per_gpu: Annotated[int, Field(ge=1, le=64)] = 1

    @model_validator(mode="after")
    def _explicit_needs_cpus(self):
        if self.mode == "explicit" and not self.cpus:
            raise ValueError("mode explicit needs cpus: one list of CPU ids per worker")
        if self.mode != "explicit" and self.cpus:
            raise ValueError(f"cpus is only used with mode explicit (mode is {self.mode})")
        return self


class SupervisionSection(Section):
    restart_backoff_seconds: Annotated[float, Field(gt=0, le=60)] = 0.1
    """Delay before a dead worker is replaced; doubles with each death, reset by a ready worker."""
    restart_backoff_max_seconds: Annotated[float, Field(gt=0, le=3600)] = 5.0
    crash_loop_deaths: Annotated[int, Field(ge=1, le=100_000)] = 5
    """This many unexpected worker deaths within crash_loop_window_seconds: stop replacing
    workers and report not ready (/readyz 503) with the reason."""
    crash_loop_window_seconds: Annotated[float, Field(gt=0, le=86400)] = 60.0


class MonitorsSection(Section):
    interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0
    window_seconds: Annotated[float, Field(gt=0, le=86400)] = 10.0


class AutotuneSection(Section):
    enabled: bool = True
    policy: str = "auto"
    """Policy file: `builtin:NAME` for a shipped one, or a path (relative: to the current directory);
    auto: builtin:default for embeddings, builtin:generate for generation (ServerConfig resolves it)."""
    interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 2.0
    cooldown_seconds: Annotated[float, Field(ge=0, le=3600)] = 4.0
    dry_run: bool = False
    audit_log: str | None = None
    allow_oversubscription: bool = False
    memory_budget_bytes: Annotated[int, Field(ge=1)] | None = None

    def policy_path(self) -> Path:
        return shipped.resolve(self.policy, shipped.POLICY)


class ClusterSection(Section):
    """`selftune serve --ray`: replicas of the whole server on a Ray cluster."""

    min_replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=10_000)] = 4
    policy: str = "builtin:replicas"
    """Cluster policy file (`kind: replicas`): `builtin:NAME` for a shipped one, or a path."""
    interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """How often Ray Serve runs the cluster policy (its autoscaling loop)."""
    audit_log: str | None = None
    """JSONL file every cluster decision is appended to, on the head node."""
    replica_cpus: Annotated[float, Field(gt=0)] | None = None
    """CPUs a replica reserves from Ray (null: 1). At most one replica runs on a node and it uses
    all of that node's CPUs, whatever it reserves."""
    ingress: Literal["proxy", "haproxy"] = "proxy"
    """proxy: Ray Serve's Python proxies, with selftune's middleware (embeddings retried when their
    replica dies, a typed error for a broken stream); haproxy: Ray Serve's direct ingress, each
    replica serving HTTP itself behind HAProxy, far less CPU per request, HAProxy's own retries
    (a request whose replica closed without an answer), streams cut without an event."""
    retries: Annotated[int, Field(ge=0, le=10)] = 3
    """Times an embeddings request is sent again to another replica when its replica dies."""

    @model_validator(mode="after")
    def _range(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is more than max_replicas ({self.max_replicas})")
        return self

    def policy_path(self) -> Path:
        return shipped.resolve(self.policy, shipped.CLUSTER_POLICY)


class AdminSection(Section):
    token_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "SELFTUNE_ADMIN_TOKEN"


class ServerConfig(Section):
    server: ServerSection = ServerSection()
    model: ModelSection = ModelSection()
    concurrency: ConcurrencySection = ConcurrencySection()
    bounds: BoundsSection = BoundsSection()
    limits: LimitsSection = LimitsSection()
    placement: PlacementSection = PlacementSection()
    supervision: SupervisionSection = SupervisionSection()
    monitors: MonitorsSection = MonitorsSection()
    autotune: AutotuneSection = AutotuneSection()
    admin: AdminSection = AdminSection()
    cluster: ClusterSection = ClusterSection()

    @model_validator(mode="after")
    def _task_policy(self):
        # The task decides the default policy: generation is tuned against TTFT and ITL, not a batch p99.
        if self.autotune.policy == "auto":
            policy = "builtin:generate" if self.model.task == "generate" else "builtin:default"
            self.autotune = self.autotune.model_copy(update={"policy": policy})
        return self

    def bounds_obj(self) -> Bounds:
        base = Bounds()
        changes = {}
        if self.placement.mode == "explicit":
            changes["process_count"] = (len(self.placement.cpus),) * 2
        for name in Bounds.__dataclass_fields__:
            rng = getattr(self.bounds, name)
            if rng is not None and name not in changes:
                kind = float if name == "batch_timeout" else int
                changes[name] = (kind(rng.min), kind(rng.max))
        return Bounds(**{**{n: getattr(base, n) for n in Bounds.__dataclass_fields__}, **changes})

    def knobs(self) -> Knobs:
        c = self.concurrency
        count = c.process_count
        if self.placement.mode == "explicit":
            count = len(self.placement.cpus)
        if count == "auto":
            count = max(1, len(os.sched_getaffinity(0)) // c.threads_per_process)
            count = min(count, self.bounds_obj().process_count[1])
        tokens = c.max_batch_tokens
        if tokens == "auto":  # device auto is sized as a CPU; `device: cuda` (or the knob itself) for a GPU
            tokens = auto_batch_tokens(self.model.device, c.threads_per_process)
        return Knobs(count, c.threads_per_process, c.io_threads, c.batch_timeout, c.max_batch_size, tokens, c.kv_tokens)

    def engine_config(self) -> EngineConfig:
        m = self.model
        return EngineConfig(
            model=m.name, task=m.task, device=m.device, dtype=m.dtype, backend=m.backend, max_input_tokens=m.max_input_tokens,
            kv_cache_mib=m.kv_cache_mib, pack_row_tokens=m.pack_row_tokens, knobs=self.knobs(), bounds=self.bounds_obj(),
            measure_batch_tokens=self.concurrency.max_batch_tokens == "auto" and not m.device.startswith("cuda"),
            restart_backoff=(self.supervision.restart_backoff_seconds, self.supervision.restart_backoff_max_seconds),
            placement=self.placement.mode,
            placement_cpus=tuple(tuple(cpus) for cpus in self.placement.cpus) if self.placement.cpus else None,
            workers_per_gpu=self.placement.workers_per_gpu,
            crash_loop=(self.supervision.crash_loop_deaths, self.supervision.crash_loop_window_seconds),
            queue_timeout=self.limits.queue_timeout_seconds,
        )

    def server_limits(self) -> ServerLimits:
        lim = self.limits
        return ServerLimits(
            max_items_per_request=lim.max_items_per_request,
            max_body_bytes=lim.max_body_bytes,
            max_queued_requests=lim.max_queued_requests,
            max_queued_tokens=lim.max_queued_tokens,
            request_timeout=lim.request_timeout_seconds,
            default_max_tokens=lim.default_max_tokens,
            retry_after_seconds=lim.retry_after_seconds,
        )


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> ServerConfig:
    """Read, merge command-line overrides ({"section.key": value}), validate, check the knobs."""
    path, raw = _read(path)
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".")
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"{path}: {section}: must be a mapping")
        raw[section][key] = value
    try:
        config = ServerConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(path, exc)) from None
    try:
        config.bounds_obj().validate(config.knobs())
    except ValueError as exc:
        raise ConfigError(f"{path}: concurrency.{exc} (see the bounds: section)") from None
    if config.autotune.enabled:
        try:
            config.autotune.policy_path()
        except FileNotFoundError as exc:
            raise ConfigError(f"{path}: autotune.policy: {config.autotune.policy}: {exc.strerror}") from None
    try:
        config.cluster.policy_path()
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: cluster.policy: {config.cluster.policy}: {exc.strerror}") from None
    return config


def effective_config(path: str | Path | None = None, overrides: dict | None = None) -> str:
    """The config `load_config` gives, as YAML a user can start a file from: every key, each
    value with where it came from (the command line, the file, or the built-in default)."""
    overrides = overrides or {}
    config = load_config(path, overrides)
    source, raw = _read(path)
    name = "builtin:default" if source == DEFAULT_CONFIG else str(source)
    lines = [f"# selftune's effective config: the defaults, then {name}, then the command line"]
    for section, values in config.model_dump().items():
        lines.append(f"{section}:")
        for key, value in values.items():
            origin = "command line" if f"{section}.{key}" in overrides else name if key in raw.get(section, {}) else "default"
            if (section, key) == ("concurrency", "process_count") and value == "auto":
                origin += f"; auto is {config.knobs().process_count} on this machine"
            text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).removesuffix("\n...\n").strip()
            lines.append(f"  {key}: {text}   # {origin}")
    return "\n".join(lines) + "\n"


def _read(path: str | Path | None) -> tuple[Path, dict]:
    """The file a --config value names, and its top-level mapping."""
    try:
        path = shipped.resolve(path, shipped.CONFIG) if path is not None else DEFAULT_CONFIG
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        path = exc.filename if exc.filename is not None else path
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return path, raw


def _describe(path: Path, exc: ValidationError) -> str:
    lines = [f"{path}: invalid configuration"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (see docs/CONFIG.md for the keys allowed)")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)
