"""OUT/gpu_check.json, OUT/gpu_check.md and the summary table printed at the end."""

from __future__ import annotations

import json
import os


def table(records: list[dict]) -> str:
    """The steps as a Markdown table (also what is printed)."""
    rows = ["| step | status | seconds | budget | result |", "| --- | --- | ---: | ---: | --- |"]
    for r in records:
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        over = " over budget" if r.get("over_budget") else ""
        result = r.get("error") or (r.get("details") or {}).get("summary", "")
        rows.append(f"| {r['name']} | {status} | {r['seconds']:.1f}{over} | {r['budget_s']} | {_cell(result)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    text = str(text).replace("|", "/").replace("\n", " ")
    return text if len(text) <= 220 else text[:217] + "..."


def headline(records: list[dict]) -> dict:
    """The numbers docs/BENCHMARKS.md waits for, pulled out of the steps' details."""
    by = {r["name"]: r.get("details") or {} for r in records}
    out = {}
    for name in ("serve_embed_wpg1", "serve_embed_wpg2"):
        answers = by.get(name, {}).get("answers", {})
        if answers:
            out[f"{name}_min_cosine"] = answers.get("min_cosine")
    prompts = by.get("serve_generate", {}).get("answers", {}).get("prompts")
    if prompts:
        out["greedy_equal"] = f"{sum(p['equal'] for p in prompts)}/{len(prompts)}"
    bench = by.get("bench_embed", {})
    if bench.get("max_qps") is not None:
        out.update({"embed_max_qps": bench["max_qps"], "embed_p99_ms_at_max": bench.get("p99_ms")})
    stream = by.get("stream_generate", {})
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_second"):
        if key in stream:
            out[f"stream_{key}"] = stream[key]
    return out


def write(out: str, summary: dict) -> tuple[str, str]:
    json_path = os.path.join(out, "gpu_check.json")
    md_path = os.path.join(out, "gpu_check.md")
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(markdown(summary))
    return json_path, md_path


def markdown(s: dict) -> str:
    env = next((r.get("details") or {} for r in s["steps"] if r["name"] == "environment"), {})
    lines = [f"# GPU check ({s['mode']})", "", f"Started {s['started_at']}, {s['seconds']:.0f} s in all; "
             f"budget {s['budget_run_s']} s for the steps this mode runs ({s['budget_gpu_run_s']} s for a GPU run, "
             f"limit 480 s). Result: **{'ok' if s['ok'] else 'FAILED'}** "
             f"({s['counts']['passed']} passed, {s['counts']['failed']} failed, {s['counts']['skipped']} skipped).", ""]
    if env.get("summary"):
        lines += [f"Machine: {env['summary']}; {env.get('platform', '')}, {env.get('usable_cpus')} usable CPUs.", ""]
    lines += [table(s["steps"]), ""]
    if s.get("headline"):
        lines += ["## Numbers", "", "| figure | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in s["headline"].items()] + [""]
    failed = [r for r in s["steps"] if r["status"] == "failed"]
    if failed:
        lines += ["## Failures", ""]
        for r in failed:
            lines += [f"### {r['name']}", "", r.get("error", ""), ""]
            tail = (r.get("details") or {}).get("log_tail") or (r.get("details") or {}).get("output_tail")
            if tail:
                body = "\n".join(tail) if isinstance(tail, list) else str(tail)
                lines += ["```", body[-4000:], "```", ""]
    lines += ["Everything measured is in gpu_check.json beside this file (server logs under logs/).", ""]
    return "\n".join(lines)
