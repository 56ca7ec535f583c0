"""The steps that run `selftune serve`: embeddings and generation on CUDA (c, d), the embedding
bench and the streaming generation load (e), and the CPU stand-in a dry run uses instead."""

from __future__ import annotations

import json
import os
import subprocess

from gpucheck import checks, load, steps
from gpucheck.common import Fail, rounded, say
from gpucheck.server import ServeProcess, selftune_command

LOAD_SECONDS = 4.0
STREAM = {"concurrency": 32, "rounds": 2, "max_tokens": 64}
STREAM_DRY = {"concurrency": 2, "rounds": 1, "max_tokens": 8}


def _server(ctx: steps.Context, name: str, checks_seconds: float = 12.0) -> ServeProcess:
    """Start the server of config `name` (writing the configs first if that step did not run).

    If a config with `model.dtype: auto` does not start on CUDA, the dtype auto would pick is
    named instead (bf16, else fp16), for this server and every later one; the step still fails,
    with the first attempt in its details (`first_failure`), so the defect stays visible."""
    if not ctx.configs:
        steps.configs(ctx)
    # at least 45 s: a first start on a new machine is the one figure not yet measured; a slow
    # start is recorded as over budget rather than lost
    timeout = max(45.0, ctx.budget * ctx.timeout_factor - checks_seconds)
    say(f"  starting selftune serve with configs/{name}.yaml (ready within {timeout:.0f} s)")
    auto = steps.config_set(ctx)[name]["model"]["dtype"] == "auto"
    try:
        return ServeProcess(ctx.configs[name], ctx.path("logs", f"{name}.log"), env=ctx.server_env).start(timeout)
    except Fail as exc:
        said = f"{exc} {exc.details}".lower()
        if not (auto and ctx.cuda and ("cuda" in said or "crash loop" in said)):
            raise
        ctx.dtype_override = "bfloat16" if ctx.bf16 else "float16"
        ctx.workaround.append(f"model.dtype {ctx.dtype_override} instead of auto (auto did not start on CUDA: {exc})")
        say(f"  dtype auto did not start on CUDA ({exc}); again with model.dtype {ctx.dtype_override}")
        steps.write_configs(ctx)
        server = ServeProcess(ctx.configs[name], ctx.path("logs", f"{name}-{ctx.dtype_override}.log"), env=ctx.server_env)
        server.first_failure = {"error": str(exc), "log_tail": exc.details.get("log_tail")}
        return server.start(timeout)


def _finish(server: ServeProcess, details: dict) -> dict:
    """Stop the server (if still running) and fail the step on a bad exit or a first failure."""
    code = server.stop()
    details["server_exit_code"] = code
    if code not in (0, None):
        raise Fail(f"selftune serve exited with {code} on SIGTERM", {**details, "log_tail": server.log_tail()})
    if server.first_failure:
        raise Fail(f"the shipped model.dtype auto did not start on CUDA ({server.first_failure['error']}); with "
                   "the dtype named instead, the checks in the details ran", {**details, "first_attempt": server.first_failure})
    return details


def _serve_step(ctx: steps.Context, name: str, kind: str, workers: int, wpg: int) -> dict:
    ref = ctx.reference()
    server = _server(ctx, name)
    try:
        details = checks.serve_checks(server, ref, kind, workers, wpg, "cuda", LOAD_SECONDS)
    finally:
        server.stop()
    details["workaround"] = list(ctx.workaround)
    details["summary"] = _serve_summary(details)
    return _finish(server, details)


def _serve_summary(details: dict) -> str:
    answers, gpu = details.get("answers", {}), details.get("gpu", {}).get("metrics", {})
    if "min_cosine" in answers:
        head = f"min cosine {answers['min_cosine']}"
    else:
        head = f"greedy equal {sum(p['equal'] for p in answers.get('prompts', []))}/{len(answers.get('prompts', []))}"
    figures = [f"gpu {g}: util max {v.get('selftune_gpu_utilization_ratio', 0):.0%}, "
               f"{v.get('selftune_gpu_memory_used_bytes', 0) / 2**30:.1f} GiB, {v.get('selftune_gpu_power_watts', 0):.0f} W"
               for g, v in gpu.items()]
    return "; ".join([head, *figures])


def serve_embed_wpg1(ctx: steps.Context) -> dict:
    return _serve_step(ctx, "embed-wpg1", "embed", workers=1, wpg=1)


def serve_embed_wpg2(ctx: steps.Context) -> dict:
    return _serve_step(ctx, "embed-wpg2", "embed", workers=2, wpg=2)


def serve_generate(ctx: steps.Context) -> dict:
    return _serve_step(ctx, "generate-greedy", "generate", workers=1, wpg=1)


def stream_generate(ctx: steps.Context) -> dict:
    server = _server(ctx, "generate-stream", checks_seconds=15.0)
    try:
        details = {"banner": server.banner(), "ready_seconds": server.ready_seconds, **load.stream_load(server.url, **STREAM)}
        details["server_log_notable"] = server.notable_log_lines()
    finally:
        server.stop()
    details["summary"] = _stream_summary(details)
    return _finish(server, details)


def _stream_summary(d: dict) -> str:
    return (f"TTFT p50/p99 {d['ttft_p50_ms']}/{d['ttft_p99_ms']} ms, ITL p50/p99 {d['itl_p50_ms']}/{d['itl_p99_ms']} ms, "
            f"{d['output_tokens_per_second']} output tok/s")


def bench_embed(ctx: steps.Context) -> dict:
    """`selftune bench --quick` against a GPU server (autotuned, the default policy)."""
    server = _server(ctx, "embed-bench", checks_seconds=0.0)
    out = os.path.dirname(ctx.path("bench-embed", "bench.json"))
    command = selftune_command() + ["bench", "--url", server.url, "--quick", "--start-rate", str(ctx.bench_start_rate),
                                    "--slo", "0.5", "--out", out, "--json"]
    left = max(20.0, ctx.budget * ctx.timeout_factor - server.ready_seconds)
    say(f"  {' '.join(command[1:])} (at most {left:.0f} s)")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=left, cwd=ctx.out)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise Fail(f"selftune bench did not finish within {left:.0f} s", {"stderr_tail": tail[-3000:]}) from None
    finally:
        server.stop()
    with open(os.path.join(out, "bench.log"), "w") as f:
        f.write(done.stderr)
    if done.returncode != 0:
        raise Fail(f"selftune bench exited with {done.returncode}", {"stderr_tail": done.stderr[-3000:]})
    details = bench_details(json.loads(done.stdout.strip().splitlines()[-1]))
    details.update({"command": " ".join(command), "outputs": out, "banner": server.banner()})
    if not details["max_qps"]:
        raise Fail("the bench found no rate that met the SLO", details)
    return _finish(server, details)


def bench_details(result: dict) -> dict:
    """The figures of `selftune bench --json`'s summary that the report keeps."""
    mode = result["modes"][0]
    at = mode.get("at_max") or {}
    gen = result.get("generator_check") or {}
    details = {"max_qps": rounded(mode["max_qps"], 1), "p50_ms": rounded((at.get("p50") or 0) * 1000, 2),
               "p99_ms": rounded((at.get("p99") or 0) * 1000, 2), "batch_items": rounded(at.get("batch_items"), 2),
               "server_cpu_cores": rounded(at.get("cpu_cores"), 2), "final_knobs": mode.get("final_knobs"),
               "generator": {k: rounded(gen.get(k), 2) for k in ("offered", "achieved", "lag_p99_ms")},
               "ladder": [{k: rounded(s.get(k), 4) for k in ("offered", "throughput", "p99")} | {"passed": s.get("passed")}
                          for s in mode.get("steps", [])]}
    details["summary"] = (f"{details['max_qps']} req/s within p99 0.5 s (p99 {details['p99_ms']} ms, "
                          f"{details['batch_items']} items/batch); generator {gen.get('achieved') or 0:.0f}/{gen.get('offered') or 0:.0f} req/s")
    return details


def cpu_standin(ctx: steps.Context) -> dict:
    """A dry run's stand-in: the serve checks' plumbing on CPU servers (answers against the
    reference, workers, /metrics, /stats, /stats/history) and a tiny streaming load."""
    ref = ctx.reference()
    details = {}
    for name, kind in (("cpu-embed", "embed"), ("cpu-generate", "generate")):
        server = _server(ctx, name, checks_seconds=25.0)
        try:
            details[name] = checks.serve_checks(server, ref, kind, 1, None, "cpu", 2.0)
            if kind == "generate":
                details[name]["stream"] = load.stream_load(server.url, **STREAM_DRY)
        finally:
            server.stop()
        _finish(server, details[name])
    stream = details["cpu-generate"]["stream"]
    details["summary"] = (f"CPU: min cosine {details['cpu-embed']['answers']['min_cosine']}, greedy equal "
                          f"{sum(p['equal'] for p in details['cpu-generate']['answers']['prompts'])}/{len(ref['generate']['prompts'])}, "
                          f"stream TTFT p50 {stream['ttft_p50_ms']} ms")
    return details
