"""The GPU check's steps. Each takes the run's Context and returns its details (with a one-line
`summary`), or raises Skip / Fail. Their order, budgets and CUDA needs: STEPS in scripts/gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from gpucheck import reference
from gpucheck.common import Fail, say, to_yaml
from gpucheck.server import selftune_command

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BENCH_FLAGS = ("--url", "--quick", "--start-rate", "--slo", "--out", "--json", "--no-generator-check")


@dataclass
class Context:
    out: str
    dry_run: bool
    bench_start_rate: float = 400.0
    timeout_factor: float = 1.25
    cuda: bool = False
    bf16: bool = False
    environment: dict = field(default_factory=dict)
    server_env: dict = field(default_factory=dict)
    dtype_override: str | None = None
    workaround: list[str] = field(default_factory=list)
    configs: dict[str, str] = field(default_factory=dict)
    _reference: dict | None = None
    budget: float = 0.0  # the running step's, seconds
    blocked: str | None = None  # set when a failed step leaves the rest nothing to run on

    def reference(self) -> dict:
        if self._reference is None:
            self._reference = reference.compute()
            with open(os.path.join(self.out, "reference.json"), "w") as f:
                json.dump(self._reference, f)
        return self._reference

    def path(self, *parts: str) -> str:
        path = os.path.join(self.out, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def child_env(self) -> dict:
        """The environment of child interpreters: the checkout importable, output unbuffered."""
        path = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO + (os.pathsep + path if path else "")}


def run_python(ctx: Context, args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env={**ctx.child_env(), **(env or {})})
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout or b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise Fail(f"python {' '.join(args[:4])} did not finish within {timeout:.0f} s", {"output_tail": tail[-3000:]}) from None


# --- a. environment, fork safety -------------------------------------------------------------

def environment(ctx: Context) -> dict:
    done = run_python(ctx, [os.path.join(HERE, "probe.py"), "env"], timeout=ctx.budget * ctx.timeout_factor)
    if done.returncode != 0:
        raise Fail("the environment probe failed", {"stderr_tail": done.stderr[-3000:]})
    env = ctx.environment = json.loads(done.stdout.strip().splitlines()[-1])
    torch_info, nvml = env.get("torch", {}), env.get("nvml", {})
    ctx.cuda = bool(torch_info.get("cuda_available"))
    ctx.bf16 = bool(torch_info.get("bf16_supported"))
    gpus = ", ".join(d["name"] for d in torch_info.get("devices", [])) or "none"
    env["summary"] = (f"python {env['python']}, torch {torch_info.get('version')} (CUDA {torch_info.get('built_with_cuda')}), "
                      f"GPUs: {gpus}, driver {nvml.get('driver', 'n/a')}, NVML {'yes' if nvml.get('available') else 'no'}")
    try:
        env["selftune_command"] = selftune_command()[0]
    except Fail:
        env["missing_modules"].append("the selftune command")
    if env["missing_modules"]:
        raise Fail(f"missing: {', '.join(env['missing_modules'])}; install with scripts/gpu_check.sh --install "
                   "(or --offline-wheelhouse DIR)", env)
    if not ctx.cuda and not ctx.dry_run:
        raise Fail(f"CUDA is not available to torch {torch_info.get('version')} (built with CUDA "
                   f"{torch_info.get('built_with_cuda')}); NVML: {nvml.get('reason') or nvml.get('driver')}", env)
    return env


def fork_probe(ctx: Context) -> dict:
    """What a child forked after a CUDA query can do here (the zygote's situation). Sets the
    servers' PYTORCH_NVML_BASED_CUDA_CHECK=1 when only the NVML-based query keeps forks usable."""
    variants = [("is-available", {}), ("bf16-query", {}), ("nvml-is-available", {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"})]
    found = {}
    for variant, env in variants:
        done = run_python(ctx, [os.path.join(HERE, "probe.py"), "fork", variant], timeout=30, env=env)
        found[variant] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
            "child": {"ok": False, "error": f"probe exited {done.returncode}: {done.stderr[-500:]}"}}
        say(f"  fork after {variant}: the child {'can' if found[variant]['child']['ok'] else 'can NOT'} use CUDA")
    ok = {v: found[v]["child"]["ok"] for v in found}
    if not ok["is-available"] and ok["nvml-is-available"]:
        ctx.server_env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        ctx.workaround.append("PYTORCH_NVML_BASED_CUDA_CHECK=1 for the servers (a plain is_available() breaks forked children)")
    details = {"variants": found, "server_env": ctx.server_env,
               "summary": "; ".join(f"fork after {v}: {'ok' if good else 'BREAKS CUDA'}" for v, good in ok.items())}
    if not ok["is-available"] and not ok["nvml-is-available"]:
        raise Fail("no CUDA query tried leaves a forked child able to use CUDA: the zygote's workers cannot run "
                   f"here ({found['is-available']['child'].get('error')})", details)
    return details


# --- references and configs -------------------------------------------------------------------

def references(ctx: Context) -> dict:
    ref = ctx.reference()
    margins = [p["min_margin"] for p in ref["generate"]["prompts"]]
    return {"embed_texts": len(ref["embed"]["texts"]), "greedy_prompts": len(margins), "min_greedy_margins": margins,
            "file": os.path.join(ctx.out, "reference.json"),
            "summary": f"{len(ref['embed']['texts'])} embeddings, {len(margins)} greedy prompts (min margin {min(margins):.3f})"}


def server_config(model: str, task: str, device: str, dtype: str, workers: int, wpg: int, batch: int,
                  policy: str = "builtin:static", max_workers: int = 16) -> dict:
    return {
        "server": {"host": "127.0.0.1", "log_level": "info", "shutdown_grace_seconds": 5},
        "model": {"name": model, "task": task, "device": device, "dtype": dtype},
        "concurrency": {"process_count": workers, "threads_per_process": 1, "io_threads": 2, "max_batch_size": batch},
        "bounds": {"process_count": {"min": 1, "max": max_workers}},
        "placement": {"workers_per_gpu": wpg},
        "monitors": {"interval_seconds": 1.0},
        "autotune": {"enabled": True, "policy": policy},
    }


def config_set(ctx: Context) -> dict[str, dict]:
    auto = ctx.dtype_override or "auto"
    minilm, smol = reference.EMBED_MODEL, reference.GEN_MODEL
    return {
        "embed-wpg1": server_config(minilm, "embed", "cuda", auto, 1, 1, 32),
        "embed-wpg2": server_config(minilm, "embed", "cuda", auto, 2, 2, 32),
        "embed-bench": server_config(minilm, "embed", "cuda", auto, 2, 2, 32, policy="builtin:default", max_workers=8),
        # float32 for exact greedy equality with the CPU; the stream load runs the shipped dtype
        "generate-greedy": server_config(smol, "generate", "cuda", "float32", 1, 1, 8),
        "generate-stream": server_config(smol, "generate", "cuda", auto, 2, 2, 32),
        "cpu-embed": server_config(minilm, "embed", "cpu", "auto", 1, 1, 16),
        "cpu-generate": server_config(smol, "generate", "cpu", "auto", 1, 1, 4),
    }


def write_configs(ctx: Context) -> None:
    for name, data in config_set(ctx).items():
        ctx.configs[name] = ctx.path("configs", f"{name}.yaml")
        with open(ctx.configs[name], "w") as f:
            f.write(f"# written by scripts/gpu_check.py for its {name} step\n" + to_yaml(data))


def configs(ctx: Context) -> dict:
    """Write the temporary server configs, have `selftune config show` accept each, and check
    that `selftune bench` still has the flags the bench step passes."""
    write_configs(ctx)
    cli = selftune_command()
    commands = {name: cli + ["config", "show", "--config", path] for name, path in ctx.configs.items()}
    commands["bench --help"] = cli + ["bench", "--help"]
    run = lambda c: subprocess.run(c, capture_output=True, text=True, timeout=60, cwd=ctx.out)  # noqa: E731
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(commands, pool.map(run, commands.values())))
    bad = {n: d.stderr[-800:] for n, d in done.items() if d.returncode != 0}
    missing = [flag for flag in BENCH_FLAGS if flag not in done["bench --help"].stdout]
    details = {"configs": ctx.configs, "dtype_override": ctx.dtype_override, "bench_flags_missing": missing,
               "summary": f"{len(ctx.configs)} configs accepted by `selftune config show`"}
    if bad or missing:
        raise Fail(f"configs rejected: {sorted(bad)}; bench flags missing: {missing}", {**details, "errors": bad})
    return details


# --- b. the GPU-marked tests -----------------------------------------------------------------------

def gpu_tests(ctx: Context) -> dict:
    log = ctx.path("gpu-tests.log")
    args = ["-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-rA", "-p", "no:cacheprovider"]
    done = run_python(ctx, args, timeout=ctx.budget * ctx.timeout_factor)
    with open(log, "w") as f:
        f.write(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    tally = lines[-1].strip("= ") if lines else "no output"
    outcomes = [line for line in lines if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))]
    details = {"command": "python " + " ".join(args), "result": tally, "outcomes": outcomes, "log": log, "summary": tally}
    if done.returncode != 0:
        raise Fail(f"pytest -m gpu: {tally}", {**details, "output_tail": done.stdout[-4000:]})
    if not ctx.cuda and "passed" in tally:
        raise Fail(f"GPU tests passed without CUDA (they must skip): {tally}", details)
    return details
