"""One judged step of streamed generation at an offered rate: TTFT, ITL, end-to-end, tokens/s, goodput.

`judge_generation` is pure (stream results in, a verdict out). A step passes when, over the
requests scheduled after the settling share, nothing failed (a 429 is a failure), the TTFT p99
is within its objective and the p99 of every inter-token gap is within its own. Streams still
open at the cut count with what they showed: a TTFT not seen yet is at least the time waited
(longer than the objective, as the cut comes `grace` ≥ the TTFT objective after the last
arrival), and a gap still open is kept once it has passed the ITL objective.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from autotune.bench.stream_loadgen import StreamResult


@dataclass(frozen=True, slots=True)
class GenStepResult:
    offered: float
    """Requests per second sent (Poisson)."""
    judged: int
    """Requests scheduled in the judged part of the step."""
    failed: int
    """Of those, failed (non-200, an error event, connection failures)."""
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    """Seconds, from the scheduled send time (TTFT) and between tokens (ITL, every gap of the judged requests)."""
    e2e_mean: float
    e2e_p99: float
    """Scheduled time to the last token, over the judged requests that finished before the cut."""
    output_tokens_per_s: float
    """Tokens that arrived within the judged window (any request's) per second of it."""
    goodput: float
    """Judged requests per second of the window that met both objectives: TTFT and their mean
    gap (time per output token, as DistServe and vLLM's --goodput define it)."""
    goodput_tokens_per_s: float
    """The output tokens of those requests per second of the window."""
    passed: bool
    cpu_cores: float
    """Cores the server used during the step (CPU seconds of all its processes / wall seconds)."""
    lag_p99: float
    """The generator's own p99 delay in sending (it must stay far below the latencies)."""
    statuses: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    """Judged requests that finished before the cut."""
    cut: int = 0
    """Judged requests still streaming (or waiting) when the step was cut."""
    running: float = math.nan
    """Mean sequences in the server's running batches, all workers together, over the judged
    window (polled from /stats); NaN when not known."""
    prompt_tokens: float = math.nan
    """Mean prompt tokens the server counted for the judged requests that reported usage."""

    def as_dict(self) -> dict:
        return asdict(self)


def _p(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _gaps(r: StreamResult, itl_slo: float) -> np.ndarray:
    """A request's inter-token gaps; for a cut stream also the open one, once it has passed the objective."""
    gaps = r.itls()
    if not math.isnan(r.cut_at) and r.token_times and r.cut_at - r.token_times[-1] > itl_slo:
        gaps = np.append(gaps, r.cut_at - r.token_times[-1])
    return gaps


def _per_chunk(r: StreamResult) -> float:
    """Tokens per text chunk of a request: usage / chunks once it finished, else 1."""
    return r.output_tokens / len(r.token_times) if r.completed and r.token_times and r.output_tokens > len(r.token_times) else 1.0


def _tokens_between(r: StreamResult, t0: float, t1: float) -> float:
    """A request's output tokens that arrived between t0 and t1 (run clock); a finished stream
    without any text chunk (all its tokens detokenized to nothing) counts its tokens at its end."""
    if r.completed and not r.token_times:
        return r.output_tokens if t0 <= r.sent_at + r.latency <= t1 else 0
    return _per_chunk(r) * sum(1 for t in r.token_times if t0 <= r.sent_at + t <= t1)


def _good(r: StreamResult, ttft_slo: float, itl_slo: float) -> bool:
    """TTFT and mean gap within the objectives (of what the request showed before any cut)."""
    if not r.ok or not r.ttft <= ttft_slo:  # NaN (no answer) is not good either
        return False
    gaps = r.itls()
    return not len(gaps) or float(gaps.mean()) <= itl_slo


def judge_generation(results: list[StreamResult], offered: float, judged_from: float, seconds: float, ttft_slo: float, itl_slo: float,
                     cpu_cores: float = math.nan, running: float = math.nan) -> GenStepResult:
    """A step's numbers over the requests scheduled at or after `judged_from` seconds, its window ending at `seconds`."""
    judged = [r for r in results if r.sent_at >= judged_from]
    ok = [r for r in judged if r.ok]
    ttfts = np.array([r.ttft for r in ok if not math.isnan(r.ttft)])
    gaps = [_gaps(r, itl_slo) for r in ok]
    itls = np.concatenate(gaps) if gaps else np.zeros(0)
    done = [r for r in ok if r.completed]
    e2e = np.array([r.latency for r in done])
    window = max(1e-9, seconds - judged_from)
    # every request's tokens count, the settling part's too: what the server delivered in the window
    # (a chunk is one token unless the server held text back: a finished stream's usage says how many)
    tokens = sum(_tokens_between(r, judged_from, seconds) for r in results)
    good = [r for r in ok if _good(r, ttft_slo, itl_slo)]
    statuses: dict[str, int] = {}
    for r in judged:
        key = str(r.status) if not r.error or r.status != 200 else "200+error"
        statuses[key] = statuses.get(key, 0) + 1
    ttft_p99 = _p(ttfts, 99)
    itl_p99 = _p(itls, 99) if len(itls) else 0.0  # one-token outputs have no gaps: nothing to violate
    failed = len(judged) - len(ok)
    usage = [r.prompt_tokens for r in done if r.prompt_tokens]
    return GenStepResult(
        offered=offered, judged=len(judged), failed=failed,
        ttft_p50=_p(ttfts, 50), ttft_p99=ttft_p99, itl_p50=_p(itls, 50) if len(itls) else 0.0, itl_p99=itl_p99,
        e2e_mean=float(e2e.mean()) if len(e2e) else math.nan, e2e_p99=_p(e2e, 99),
        output_tokens_per_s=tokens / window,
        goodput=len(good) / window,
        goodput_tokens_per_s=sum(r.output_tokens if r.completed else len(r.token_times) for r in good) / window,
        passed=bool(judged) and failed == 0 and ttft_p99 <= ttft_slo and itl_p99 <= itl_slo,
        cpu_cores=cpu_cores,
        lag_p99=_p(np.array([r.lag for r in results]), 99) if results else 0.0,
        statuses=statuses,
        completed=len(done),
        cut=sum(1 for r in ok if not math.isnan(r.cut_at)),
        running=running,
        prompt_tokens=float(np.mean(usage)) if usage else math.nan,
    )
