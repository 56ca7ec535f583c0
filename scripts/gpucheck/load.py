"""A short streaming load for generation (until `selftune bench` has one, issue #19).

`concurrency` clients each send `rounds` streamed chat requests back to back, EOS ignored so
every answer is `max_tokens` long. Time to first token (TTFT) runs from the send to the first
content chunk, inter-token latency (ITL) between content chunks; output tokens per second is
all completion tokens over the wall time of the whole load.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from gpucheck.checks import served_model
from gpucheck.common import Fail, percentile, rounded, say, sse

TOPICS = ["the sea", "a robot learning to paint", "the history of bread", "a city at night",
          "how bees talk", "a lighthouse keeper", "the first snow", "a train journey"]


def _one(url: str, model: str, index: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me a story about {TOPICS[index % len(TOPICS)]}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    sent = time.monotonic()
    times: list[float] = []
    usage = None
    for at, event in sse(url + "/v1/chat/completions", body, timeout=180):
        usage = event.get("usage") or usage
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
            times.append(at)
    if not times:
        raise Fail(f"request {index}: the stream carried no content")
    tokens = usage["completion_tokens"] if usage else len(times)
    return {"ttft": times[0] - sent, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens, "seconds": times[-1] - sent}


def stream_load(url: str, concurrency: int, rounds: int, max_tokens: int) -> dict:
    """Run the load; raise Fail when any request failed or came back short."""
    model = served_model(url)
    total = concurrency * rounds
    say(f"  {concurrency} concurrent streams x {rounds} rounds, {max_tokens} tokens each")
    errors: list[str] = []
    results: list[dict] = []

    def run(i: int) -> None:
        try:
            results.append(_one(url, model, i, max_tokens))
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(exc).__name__}: {exc}")

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(run, range(total)))
    wall = time.monotonic() - started
    summary = summarize(results, wall)
    summary.update({"concurrency": concurrency, "rounds": rounds, "max_tokens": max_tokens,
                    "requests": total, "failed": len(errors), "errors": errors[:5]})
    if errors:
        raise Fail(f"{len(errors)} of {total} streamed requests failed", summary)
    short = [r["tokens"] for r in results if r["tokens"] != max_tokens]
    if short:
        raise Fail(f"{len(short)} streams ended before max_tokens (ignore_eos): {short[:5]}", summary)
    return summary


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    per_stream = [r["tokens"] / r["seconds"] for r in results if r["seconds"] > 0]

    def ms(values: list[float], q: float):
        value = percentile(values, q)
        return None if value is None else rounded(value * 1000, 2)

    return {"ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
            "output_tokens": tokens, "wall_seconds": rounded(wall, 2), "output_tokens_per_second": rounded(tokens / wall, 1),
            "per_stream_tokens_per_second_p50": rounded(percentile(per_stream, 50), 1)}
