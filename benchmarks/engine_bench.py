"""Engine benchmark: how close the serving engine gets to the model's physical limit.

Measures, on one model (default builtin:minilm) and fixed-length inputs (16 tokens):

  (a) the physical limit: raw in-process batched throughput (tokenize + forward + pool,
      EmbeddingRunner) at batch sizes 1..64, as 1 process x N threads and as N separate
      processes x 1 thread running concurrently (summed); the best of all is "the limit";
  (b) the engine's saturated throughput through the Python API (one text per request, many
      outstanding) with matching knobs, and a few nearby knob settings, as a ratio to (a);
  (c) per-request engine overhead at low load: p50 latency of sequential single-text
      requests minus the bare in-process time of the same request (batch 1, 1 thread);
  (d) memory: summed PSS of the front process + zygote + workers with 1, 2 and 4 workers.

The front process (this script) never imports torch: every in-process measurement runs in
spawned child processes, so the PSS in (d) is the engine's own.

    python benchmarks/engine_bench.py            # full run, ~4-5 minutes on 2 cores
    python benchmarks/engine_bench.py --quick    # ~1.5 minutes, shorter windows
    python benchmarks/engine_bench.py --json     # last stdout line: one JSON object
    python benchmarks/engine_bench.py --out DIR  # also writes DIR/engine_bench.{json,md}

Progress goes to stderr; the report (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from autotune.bench.inputs import texts_of_tokens  # noqa: E402
from autotune.bench.limit import child_setup, load_runner, run_layout  # noqa: E402
from autotune.bench.saturate import TARGET_TOKENS, engine_procs, saturate  # noqa: E402
from autotune.bench.machine import LoadMonitor, machine_info  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- inputs -------------------------------------------------------------------------------

# ---- (a) in-process limit: runs in spawned children ---------------------------------------


def _bare_latency_child(path, text, repeats, results):
    """Bare in-process time of one request (batch 1, 1 thread): tokenize+forward+pool, and forward+pool only."""
    try:
        child_setup(1)
        embed, runner, hidden = load_runner(path)
        import numpy as np

        _, ids, lengths = embed([text])
        out = np.empty((1, hidden), dtype=np.float32)
        for _ in range(30):
            embed([text])
        full, fwd = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            embed([text])
            full.append(time.perf_counter() - t)
            t = time.perf_counter()
            runner.run(ids, lengths, out)
            fwd.append(time.perf_counter() - t)
        gap = []  # the same forward after a 2 ms idle gap, as a worker sees it under sequential load
        for _ in range(repeats // 2):
            time.sleep(0.002)
            t = time.perf_counter()
            runner.run(ids, lengths, out)
            gap.append(time.perf_counter() - t)
        results.put({"full_p50": statistics.median(full), "forward_p50": statistics.median(fwd),
                     "forward_after_idle_p50": statistics.median(gap)})
    except BaseException as exc:
        results.put({"error": repr(exc)})


def bare_latency(ctx, path, text, repeats) -> dict:
    results = ctx.Queue()
    p = ctx.Process(target=_bare_latency_child, args=(path, text, repeats, results))
    p.start()
    out = results.get(timeout=600)
    p.join()
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


# ---- engine helpers -------------------------------------------------------------------------


def pss_report(eng) -> dict[str, float]:
    out = {}
    for name, p in engine_procs(eng).items():
        out[name] = p.memory_full_info().pss / 2**20
    out["total"] = sum(out.values())
    return out


# ---- the benchmark ----------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:minilm")
    ap.add_argument("--quick", action="store_true", help="short windows (~1.5 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    ap.add_argument("--out", help="directory for engine_bench.json and engine_bench.md")
    ap.add_argument("--outstanding", type=int, default=256,
                    help="requests kept in flight in (b); raised to 2x the engine's in-flight capacity "
                    "(workers x max_inflight_batches x max_batch_size) so the batcher always has full batches")
    ap.add_argument("--max-wait", type=float, default=30.0, help="most seconds to wait for quiet before each measurement")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for other processes to go quiet before measuring")
    args = ap.parse_args(argv)

    from engine.config import EngineConfig
    from engine.loading import load_tokenizer
    from engine.model_source import resolve_model

    quick = args.quick
    limit_secs = 0.8 if quick else 2.5
    sat_warm, sat_secs, var_secs = (1.5, 4.0, 3.0) if quick else (2.0, 10.0, 6.0)
    lat_n = 100 if quick else 400

    info = machine_info()
    log(f"machine: {info}")
    source = resolve_model(args.model, EngineConfig().cache_dir)
    tokenizer = load_tokenizer(source.path)
    texts = texts_of_tokens(tokenizer, tokens=TARGET_TOKENS)
    n_tokens = len(tokenizer(texts[0])["input_ids"])
    log(f"model {source.name} at {source.path}; {len(texts)} inputs of {n_tokens} tokens each")
    ctx = mp.get_context("spawn")
    result: dict = {"machine": info, "model": source.name, "input_tokens": n_tokens, "quick": quick}
    cores = os.cpu_count() or 1
    mon = LoadMonitor(say=log)

    def quiet():
        if not args.no_wait:
            mon.wait_quiet(max_wait=args.max_wait)

    try:
        return _run(args, result, source, texts, ctx, cores, mon, quiet, limit_secs, sat_warm, sat_secs, var_secs, lat_n)
    finally:
        mon.close()


def _run(args, result, source, texts, ctx, cores, mon, quiet, limit_secs, sat_warm, sat_secs, var_secs, lat_n) -> int:
    from engine.config import EngineConfig, Knobs
    from engine.engine import Engine

    quick = args.quick

    # (a) the physical limit
    layouts = [(1, cores), (cores, 1)] if cores > 1 else [(1, 1)]
    limit: dict[str, dict[int, float]] = {}
    other: dict[str, float] = {}
    for procs_n, threads in layouts:
        name = f"{procs_n}x{threads}"
        log(f"(a) in-process limit, {procs_n} process(es) x {threads} thread(s), batch sizes {BATCH_SIZES}, {limit_secs}s each")
        quiet()
        t0 = time.monotonic()
        limit[name] = run_layout(ctx, source.path, procs_n, threads, texts, BATCH_SIZES, limit_secs)
        other[name] = mon.foreign(t0, time.monotonic())
        log("    " + "  ".join(f"b{bs}={v:.0f}/s" for bs, v in limit[name].items()) + f"  (other load {other[name]:.2f} cores)")
    best_layout, best_bs = max(((n, bs) for n in limit for bs in limit[n]), key=lambda k: limit[k[0]][k[1]])
    best = limit[best_layout][best_bs]
    log(f"(a) limit: {best:.0f} sentences/s ({best_layout}, batch {best_bs})")
    result["limit"] = {"per_layout": {n: {str(b): v for b, v in d.items()} for n, d in limit.items()},
                       "best": best, "best_layout": best_layout, "best_batch": best_bs,
                       "other_load_cores": other}

    log(f"(c) bare in-process latency, batch 1, 1 thread, {lat_n} repeats")
    quiet()
    t0 = time.monotonic()
    bare = bare_latency(ctx, source.path, texts[0], lat_n)
    bare["other_load_cores"] = mon.foreign(t0, time.monotonic())
    log(f"    tokenize+forward+pool p50 {bare['full_p50']*1e3:.2f} ms; forward+pool p50 {bare['forward_p50']*1e3:.2f} ms; "
        f"forward+pool after 2 ms idle p50 {bare['forward_after_idle_p50']*1e3:.2f} ms")

    # (b) saturation through the Python API
    procs_n, threads = (int(x) for x in best_layout.split("x"))
    base = Knobs(process_count=procs_n, threads_per_process=threads, io_threads=2, batch_timeout=0.002, max_batch_size=best_bs)
    variants = [("base", base)]
    if not quick:
        variants += [
            ("io_threads=1", base.replace(io_threads=1)),
            (f"max_batch={max(1, best_bs // 2)}", base.replace(max_batch_size=max(1, best_bs // 2))),
            (f"max_batch={min(256, best_bs * 2)}", base.replace(max_batch_size=min(256, best_bs * 2))),
            ("batch_timeout=0", base.replace(batch_timeout=0.0)),
        ]
    else:
        variants += [("io_threads=1", base.replace(io_threads=1))]
    log(f"(b) engine saturation, >= {args.outstanding} outstanding single-text requests, knobs {base.as_dict()}")
    sat = []
    eng = Engine(EngineConfig(model=args.model, knobs=base)).start()
    try:
        eng.wait_ready(workers=procs_n)
        for label, knobs in variants:
            if knobs != eng.knobs:
                eng.apply(knobs)
                eng.wait_ready(workers=knobs.process_count)
            secs = sat_secs if label == "base" else var_secs
            quiet()
            capacity = knobs.process_count * eng.config.max_inflight_batches * knobs.max_batch_size
            r = saturate(eng, texts, max(args.outstanding, 2 * capacity), sat_warm, secs, label, mon, log)
            r["ratio"] = r["throughput"] / best
            sat.append(r)
            t = r["timings_ms"]
            log(
                f"    {label}: {r['throughput']:.1f} req/s = {r['ratio']:.2f} x limit; mean batch {r['mean_batch']:.1f}; "
                f"cpu {', '.join(f'{k} {v:.2f}' for k, v in r['cpu_share'].items())}; "
                f"model-busy {', '.join(f'{v:.2f}' for v in r['worker_model_busy'].values())}; "
                f"ms: pre {t['preprocess']:.1f} queue {t['queue']:.1f} model {t['model']:.1f} total {t['total']:.1f}; "
                f"other load {r['other_load_cores']:.2f} cores"
            )
    finally:
        eng.shutdown()
    best_sat = max(sat, key=lambda r: r["throughput"])
    result["saturation"] = {"runs": sat, "best": best_sat["label"], "best_ratio": best_sat["ratio"],
                            "base_ratio": sat[0]["ratio"]}

    # (c) low-load latency and (d) memory, on one engine grown 1 -> 2 -> 4 workers
    log("(c) sequential single-text requests, 1 worker x 1 thread, batch_timeout=0, io_threads=0 (inline tokenization)")
    knobs = Knobs(process_count=1, threads_per_process=1, io_threads=0, batch_timeout=0.0, max_batch_size=best_bs)
    eng = Engine(EngineConfig(model=args.model, knobs=knobs)).start()
    try:
        eng.wait_ready(workers=1)
        for _ in range(30):
            eng.embed(texts[0]).result(timeout=60)
        quiet()
        lats, parts = [], []
        t0 = time.monotonic()
        for _ in range(lat_n):
            t = time.perf_counter()
            r = eng.embed(texts[0]).result(timeout=60)
            lats.append(time.perf_counter() - t)
            parts.append(r.timings)
        lat_other = mon.foreign(t0, time.monotonic())
        p50 = statistics.median(lats)
        non_model = statistics.median(l - x.model for l, x in zip(lats, parts))
        med = {a: statistics.median(getattr(x, a) for x in parts) * 1e3 for a in ("preprocess", "queue", "model", "total")}
        overhead = p50 - bare["full_p50"]
        result["latency"] = {
            "engine_p50_ms": p50 * 1e3,
            "engine_p90_ms": statistics.quantiles(lats, n=10)[-1] * 1e3,
            "bare_p50_ms": bare["full_p50"] * 1e3,
            "bare_forward_p50_ms": bare["forward_p50"] * 1e3,
            "bare_forward_after_idle_p50_ms": bare["forward_after_idle_p50"] * 1e3,
            "overhead_ms": overhead * 1e3,
            "overhead_vs_forward_only_ms": (p50 - bare["forward_p50"]) * 1e3,
            "timings_p50_ms": med,
            "non_model_p50_ms": non_model * 1e3,
            "other_load_cores": lat_other,
            "bare_other_load_cores": bare["other_load_cores"],
        }
        log(f"    engine p50 {p50*1e3:.2f} ms vs bare {bare['full_p50']*1e3:.2f} ms -> overhead {overhead*1e3:.2f} ms; "
            f"latency - worker model time p50 {non_model*1e3:.2f} ms; parts {med}; other load {lat_other:.2f} cores")

        mem = {}
        for n in (1, 2, 4):
            log(f"(d) memory with {n} worker(s)")
            if eng.knobs.process_count != n:
                eng.apply(eng.knobs.replace(process_count=n))
                eng.wait_ready(workers=n)
            # a few requests on every worker: enough concurrent ones that each gets batches
            for _ in range(3):
                futs = [eng.embed(texts[i : i + 1]) for i in range(8 * n)]
                for f in futs:
                    f.result(timeout=60)
            time.sleep(0.3)
            mem[n] = pss_report(eng)
            log("    " + ", ".join(f"{k} {v:.1f} MiB" for k, v in mem[n].items()))
        result["memory_pss_mib"] = {str(n): v for n, v in mem.items()}
        result["memory_ratio_4_vs_1"] = mem[4]["total"] / mem[1]["total"]
    finally:
        eng.shutdown()

    result["targets"] = {
        "saturation_ratio_ge_0.9": best_sat["ratio"] >= 0.9,
        "overhead_le_1ms": result["latency"]["overhead_ms"] <= 1.0,
        "memory_4_le_1.5x_1": result["memory_ratio_4_vs_1"] <= 1.5,
    }
    report = render(result)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_bench.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "engine_bench.md"), "w") as f:
            f.write(report + "\n")
    if args.json:
        print(json.dumps(result))
    log("done")
    return 0


def render(r: dict) -> str:
    m = r["machine"]
    lim = r["limit"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; Python {m['python']}, "
        f"torch {m['torch']}, transformers {m['transformers']}; model {r['model']}, inputs of {r['input_tokens']} tokens"
        + (" (--quick)" if r["quick"] else ""),
        "",
        "(a) In-process limit (tokenize + forward + pool), sentences/s:",
        "",
        "| layout | " + " | ".join(f"batch {b}" for b in BATCH_SIZES) + " | other load (cores) |",
        "|---|" + "---|" * (len(BATCH_SIZES) + 1),
    ]
    for name, d in lim["per_layout"].items():
        procs_n, threads = name.split("x")
        lines.append(f"| {procs_n} proc x {threads} thread | " + " | ".join(f"{d[str(b)]:.0f}" for b in BATCH_SIZES) + f" | {lim['other_load_cores'][name]:.2f} |")
    lines += ["", "(b) Engine at saturation (one text per request):", "",
              "| knobs | req/s | ratio to limit | mean batch | model-busy per worker | CPU (cores) front / workers | mean ms pre / queue / model / total | other load (cores) |",
              "|---|---|---|---|---|---|---|---|"]
    for s in r["saturation"]["runs"]:
        k = s["knobs"]
        cpu = s["cpu_share"]
        workers = " + ".join(f"{v:.2f}" for n, v in cpu.items() if n.startswith("worker"))
        t = s["timings_ms"]
        lines.append(
            f"| {s['label']} (out {s['outstanding']}, p{k['process_count']}xt{k['threads_per_process']}, io {k['io_threads']}, "
            f"mb {k['max_batch_size']}, bt {k['batch_timeout']}) | {s['throughput']:.0f} | {s['ratio']:.2f} | "
            f"{s['mean_batch']:.1f} | {' / '.join(f'{v:.2f}' for v in s['worker_model_busy'].values())} | "
            f"{cpu['front']:.2f} / {workers} | {t['preprocess']:.1f} / {t['queue']:.1f} / {t['model']:.1f} / {t['total']:.1f} | {s['other_load_cores']:.2f} |"
        )
    lat = r["latency"]
    lines += ["", "Summary:", "", "| measure | value | target | met |", "|---|---|---|---|"]
    t = r["targets"]
    lines += [
        f"| (a) physical limit | {lim['best']:.0f} sentences/s ({lim['best_layout'].replace('x', ' proc x ')} thread, batch {lim['best_batch']}) | | |",
        f"| (b) engine saturated / limit | {r['saturation']['best_ratio']:.2f} (best: {r['saturation']['best']}; base {r['saturation']['base_ratio']:.2f}) | >= 0.9 | {'yes' if t['saturation_ratio_ge_0.9'] else 'NO'} |",
        f"| (c) engine p50 latency, 1 text | {lat['engine_p50_ms']:.2f} ms (p90 {lat['engine_p90_ms']:.2f}; other load {lat['other_load_cores']:.2f} cores) | | |",
        f"| (c) bare in-process p50 (tokenize+forward+pool; forward+pool) | {lat['bare_p50_ms']:.2f} ms; {lat['bare_forward_p50_ms']:.2f} ms | | |",
        f"| (c) per-request overhead (engine p50 - bare p50) | {lat['overhead_ms']:.2f} ms | <= 1 ms | {'yes' if t['overhead_le_1ms'] else 'NO'} |",
        f"| (c) cross-check: p50 of (latency - worker-measured model time) | {lat['non_model_p50_ms']:.2f} ms | | |",
        f"| (c) cross-check: worker-measured model time p50 vs bare forward back-to-back / after a 2 ms idle gap | {lat['timings_p50_ms']['model']:.2f} ms vs {lat['bare_forward_p50_ms']:.2f} / {lat['bare_forward_after_idle_p50_ms']:.2f} ms | | |",
    ]
    mem = r["memory_pss_mib"]
    for n in ("1", "2", "4"):
        d = mem[n]
        per = ", ".join(f"{k} {v:.0f}" for k, v in d.items() if k != "total")
        lines.append(f"| (d) PSS, {n} worker(s) | {d['total']:.0f} MiB ({per}) | | |")
    lines.append(f"| (d) PSS 4 workers / 1 worker | {r['memory_ratio_4_vs_1']:.2f} | <= 1.5 | {'yes' if t['memory_4_le_1.5x_1'] else 'NO'} |")
    tp = lat["timings_p50_ms"]
    lines += ["", f"(c) engine timings p50 (ms): preprocess {tp['preprocess']:.2f}, queue {tp['queue']:.2f}, model {tp['model']:.2f}, total {tp['total']:.2f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
