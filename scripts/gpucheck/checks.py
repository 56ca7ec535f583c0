"""What the serve steps check on a running server: answers against the CPU reference, the
workers and their placement, and the GPU figures in /metrics, /stats and /stats/history."""

from __future__ import annotations

import threading
import time

from gpucheck.common import Fail, cosine, get_json, metrics, post_json, rounded, say

COSINE_MIN = 0.999
GPU_FAMILIES = ("selftune_gpu_utilization_ratio", "selftune_gpu_memory_used_bytes", "selftune_gpu_power_watts")


def served_model(url: str) -> str:
    return get_json(url + "/v1/models")["data"][0]["id"]


# --- embeddings ----------------------------------------------------------------------------

def embed_answers(url: str, ref: dict) -> dict:
    """All reference texts in one request, then each alone: cosine against the CPU vectors."""
    model = served_model(url)
    texts, vectors = ref["texts"], ref["vectors"]
    whole = post_json(url + "/v1/embeddings", {"model": model, "input": texts})
    got = [d["embedding"] for d in sorted(whole["data"], key=lambda d: d["index"])]
    cosines = [cosine(a, b) for a, b in zip(got, vectors)]
    for i in range(0, len(texts), 5):  # a few alone as well: the padded path, not only packed rows
        alone = post_json(url + "/v1/embeddings", {"model": model, "input": texts[i]})
        cosines.append(cosine(alone["data"][0]["embedding"], vectors[i]))
    worst = min(range(len(cosines)), key=cosines.__getitem__)
    worst_text = texts[worst] if worst < len(texts) else texts[(worst - len(texts)) * 5]
    details = {"inputs_compared": len(cosines), "min_cosine": rounded(cosines[worst], 6),
               "mean_cosine": rounded(sum(cosines) / len(cosines), 6), "threshold": COSINE_MIN,
               "worst_input": worst_text[:60] + ("... (alone)" if worst >= len(texts) else "")}
    if cosines[worst] < COSINE_MIN:
        raise Fail(f"input {details['worst_input']!r} has cosine {cosines[worst]:.6f} < {COSINE_MIN} against the "
                   "CPU reference", details)
    return details


def embed_load(url: str, ref: dict) -> callable:
    """One client's loop body: 4 texts per request, each answer held to the reference."""
    model = served_model(url)
    texts, vectors = ref["texts"], ref["vectors"]
    counter = iter(range(10**9))

    def once() -> None:
        start = next(counter) * 4 % len(texts)
        picked = [(start + k) % len(texts) for k in range(4)]
        answer = post_json(url + "/v1/embeddings", {"model": model, "input": [texts[i] for i in picked]})
        for d, i in zip(sorted(answer["data"], key=lambda d: d["index"]), picked):
            if cosine(d["embedding"], vectors[i]) < COSINE_MIN:
                raise Fail(f"under load, text {i} came back with cosine below {COSINE_MIN}")
    return once


# --- generation ----------------------------------------------------------------------------

def greedy_answers(url: str, ref: dict) -> dict:
    """The reference prompts at once (continuous batching), temperature 0, EOS ignored."""
    model = served_model(url)
    prompts = ref["prompts"]
    results: list[dict | Exception] = [None] * len(prompts)

    def ask(i: int) -> None:
        body = {"model": model, "prompt": prompts[i]["prompt"], "max_tokens": ref["tokens_per_prompt"],
                "temperature": 0, "logprobs": 1, "ignore_eos": True}
        try:
            results[i] = post_json(url + "/v1/completions", body, timeout=120)
        except Exception as exc:  # noqa: BLE001 - reported below with the prompt
            results[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = [_compare_greedy(p, r) for p, r in zip(prompts, results)]
    details = {"prompts": rows, "model": model}
    bad = [r for r in rows if not r["equal"]]
    if bad:
        raise Fail(f"{len(bad)} of {len(rows)} greedy generations differ from the CPU reference", details)
    return details


def _compare_greedy(expected: dict, answer) -> dict:
    row = {"prompt": expected["prompt"], "reference_text": expected["text"], "reference_min_margin": expected["min_margin"]}
    if isinstance(answer, Exception):
        return {**row, "equal": False, "error": str(answer)}
    choice = answer["choices"][0]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    want = expected["token_texts"]
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    if first_diff is None and len(tokens) != len(want):
        first_diff = min(len(tokens), len(want))
    return {**row, "served_text": choice["text"], "equal": first_diff is None and choice["text"] == expected["text"],
            "first_difference_at": first_diff, "completion_tokens": answer["usage"]["completion_tokens"]}


def generate_load(url: str, max_tokens: int = 48) -> callable:
    model = served_model(url)

    def once() -> None:
        post_json(url + "/v1/completions", {"model": model, "prompt": "Write a short story about a robot.",
                                            "max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True}, timeout=120)
    return once


# --- workers, placement and the GPU figures --------------------------------------------------

def under_load(url: str, once: callable, seconds: float, clients: int = 8) -> dict:
    """Run `once` in `clients` threads for `seconds` while scraping /metrics every 0.5 s."""
    stop = threading.Event()
    errors: list[str] = []
    done = [0]

    def client() -> None:
        while not stop.is_set():
            try:
                once()
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 - the first few go in the report
                errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.2)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    scrapes = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        scrapes.append(metrics(url))
    stop.set()
    for t in threads:
        t.join(timeout=130)
    if errors:
        raise Fail(f"{len(errors)} request(s) failed under load", {"errors": errors[:5]})
    return {"requests": done[0], "scrapes": scrapes}


def gpu_series(scrapes: list[dict]) -> dict:
    """Per GPU: the highest utilisation, memory used and power seen across the scrapes."""
    seen: dict[str, dict] = {}
    for scrape in scrapes:
        for family in GPU_FAMILIES:
            for labels, value in scrape.get(family, []):
                gpu = seen.setdefault(labels.get("gpu", "?"), {})
                gpu[family] = max(value, gpu.get(family, float("-inf")))
    return seen


def check_gpu_figures(url: str, scrapes: list[dict]) -> dict:
    """/metrics has live NVML series; /stats and /stats/history carry what the sampler observed
    (the Observation the controller is handed)."""
    series = gpu_series(scrapes)
    stats = get_json(url + "/stats")
    observed = stats["observation"].get("gpu") or {}
    history = get_json(url + "/stats/history?seconds=30")
    with_gpus = [p for p in history.get("points", []) if p.get("gpus")]
    details = {"metrics": series, "stats_gpu": _brief_devices(observed),
               "history_points_with_gpus": len(with_gpus), "history_last_gpus": with_gpus[-1]["gpus"] if with_gpus else None}
    problems = []
    if not series:
        problems.append("/metrics has no selftune_gpu_* series")
    for gpu, values in series.items():
        for family in GPU_FAMILIES:
            if family not in values:
                problems.append(f"/metrics: gpu {gpu} has no {family}")
        if values.get("selftune_gpu_memory_used_bytes", 0) <= 0 or values.get("selftune_gpu_power_watts", 0) <= 0:
            problems.append(f"/metrics: gpu {gpu} shows no memory used or no power draw")
    if not any(v.get("selftune_gpu_utilization_ratio", 0) > 0 for v in series.values()):
        problems.append("/metrics: GPU utilisation stayed at 0 while the server was under load")
    if not observed.get("devices") or observed.get("unavailable_reason"):
        problems.append(f"/stats observation has no GPU devices ({observed.get('unavailable_reason')})")
    if not with_gpus:
        problems.append("/stats/history has no point with GPU figures")
    if problems:
        raise Fail("; ".join(problems), details)
    return details


def _brief_devices(observed: dict) -> list[dict]:
    keys = ("index", "name", "utilization_gpu", "memory_used_bytes", "memory_total_bytes", "power_watts",
            "temperature_c", "sm_clock_mhz", "processes", "numa_node")
    return [{k: d.get(k) for k in keys} for d in observed.get("devices", [])]


def check_no_gpu_figures(url: str, scrapes: list[dict]) -> dict:
    """The CPU stand-in: /metrics parses, has no GPU series, /stats says why there is no GPU."""
    if not scrapes or "selftune_requests_total" not in scrapes[-1]:
        raise Fail("/metrics has no selftune_requests_total")
    observed = get_json(url + "/stats")["observation"].get("gpu") or {}
    history = get_json(url + "/stats/history?seconds=30")
    details = {"metric_families": len(scrapes[-1]), "gpu_series": sorted(gpu_series(scrapes)),
               "stats_gpu_unavailable_reason": observed.get("unavailable_reason"),
               "history_points": len(history.get("points", []))}
    if details["gpu_series"] and not observed.get("devices"):
        raise Fail("/metrics has GPU series but /stats shows no GPU", details)
    if not history.get("points"):
        raise Fail("/stats/history has no points", details)
    return details


def check_workers(url: str, workers: int, workers_per_gpu: int | None, device: str) -> dict:
    """The configured worker count is ready, each served, and sits on the GPU the plan gives it."""
    stats = get_json(url + "/stats")
    plan = (stats.get("placement") or {}).get("workers", [])
    rows = [{"worker": w["worker_id"], "pid": w["pid"], "state": w["state"], "batches": w["batches"],
             "cpus": w.get("cpus"), "gpu": plan[i]["gpu"] if i < len(plan) else None}
            for i, w in enumerate(stats["workers"])]
    details = {"model": stats.get("model"), "workers": rows, "placement_notes": (stats.get("placement") or {}).get("notes")}
    problems = []
    if stats["ready_workers"] != workers or len(rows) != workers:
        problems.append(f"{stats['ready_workers']} ready worker(s) of {len(rows)}, expected {workers}")
    if any(r["batches"] == 0 for r in rows):
        problems.append("a worker served no batch under concurrent load")
    if not str((stats.get("model") or {}).get("device", "")).startswith(device):
        problems.append(f"model device is {(stats.get('model') or {}).get('device')}, expected {device}")
    if workers_per_gpu is not None:
        gpus = [r["gpu"] for r in rows]
        if None in gpus:
            problems.append(f"placement gives no GPU to some workers: {gpus}")
        elif workers_per_gpu > 1 and len(set(gpus)) == len(gpus):
            problems.append(f"workers_per_gpu={workers_per_gpu} but every worker has its own GPU: {gpus}")
    if problems:
        raise Fail("; ".join(problems), details)
    return details


def serve_checks(server, ref: dict, kind: str, workers: int, wpg: int | None, device: str, load_seconds: float) -> dict:
    """Everything one serve step checks, in order; `kind` is embed or generate. A failure keeps
    what was found before it in its details."""
    details: dict = {"banner": server.banner(), "ready_seconds": server.ready_seconds}
    try:
        if kind == "embed":
            details["answers"] = embed_answers(server.url, ref["embed"])
            once = embed_load(server.url, ref["embed"])
        else:
            details["answers"] = greedy_answers(server.url, ref["generate"])
            once = generate_load(server.url)
        say(f"  answers match the CPU reference; {load_seconds:g} s of load while scraping /metrics")
        loaded = under_load(server.url, once, load_seconds)
        details["load_requests"] = loaded["requests"]
        details["workers"] = check_workers(server.url, workers, wpg, device)
        if device.startswith("cuda"):
            details["gpu"] = check_gpu_figures(server.url, loaded["scrapes"])
        else:
            details["gpu"] = check_no_gpu_figures(server.url, loaded["scrapes"])
    except Fail as exc:
        exc.details = {**details, **exc.details, "server_log_notable": server.notable_log_lines()}
        raise
    details["server_log_notable"] = server.notable_log_lines()
    return details
