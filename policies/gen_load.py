"""What one window's generation observation says about the load, for the generate policy: pure
readings of an Observation (no state, no clock)."""

from __future__ import annotations

import math

from engine.config import Knobs
from monitors.observation import Observation


def bet_measure(observation: Observation, metric: str, knobs: Knobs) -> float | None:
    """ITL p50, or the cores busy in the model per output token: the ready workers' busy shares ×
    their threads over the tokens made. Unlike tokens/s, that cost does not fall with the offered
    load, which the bench's rate ladder changes every few windows."""
    if metric == "cost":
        tokens = observation.load.tokens_per_second
        busy = sum(w.busy_fraction for w in ready_workers(observation)) * knobs.threads_per_process
        return busy / tokens if tokens > 0 and busy > 0 else None
    itl = observation.load.latency.get("itl")
    return itl.p50 if itl is not None else None


def prefill_per_step(observation: Observation) -> float:
    """Prompt tokens a step would prefill, from the window: the largest of a mean prompt, the
    prompt tokens arriving during one step (about the mean inter-token latency) and the prompts
    waiting in the workers now; a smaller chunk only changes a step past it."""
    load = observation.load
    ttft, itl = load.latency.get("ttft"), load.latency.get("itl")
    if ttft is None or not ttft.count or load.items_rate <= 0:
        return 0.0  # no prompt reached a worker in the window
    prompt = mean_prompt(observation)
    waiting = sum(w.waiting_sequences for w in observation.workers)
    arriving = load.input_tokens_per_second * (itl.mean or 0.0) if itl is not None else 0.0
    return max(prompt, arriving, waiting * prompt)


def chunk_binds(observation: Observation, chunk: int) -> bool:
    """Prompts wait in a worker for more prefill than one step's chunk holds (a mean prompt each):
    the chunk is what holds them. Under load a worker nearly always has a prompt that arrived since
    its step began; that one is prefilled at the next step whatever the chunk."""
    prompt = mean_prompt(observation)
    return any(w.waiting_sequences * prompt > chunk_size(chunk) for w in ready_workers(observation))


def mean_prompt(observation: Observation) -> float:
    """Prompt tokens of the window's mean request (0 when none reached a worker)."""
    load = observation.load
    return load.input_tokens_per_second / load.items_rate if load.items_rate > 0 else 0.0


def chunk_size(tokens: int) -> float:
    """max_batch_tokens as a size: 0 prefills whole prompts, the largest chunk there is."""
    return tokens or float("inf")


def keep_up_tokens(observation: Observation) -> float:
    """Prompt tokens one worker's step must prefill for prefill to keep pace with the window's
    arrivals: each ready worker's share of the prompt tokens a second, over its steps a second."""
    itl, ready = observation.load.latency.get("itl"), ready_workers(observation)
    if itl is None or itl.mean is None or not ready:
        return 0.0
    return observation.load.input_tokens_per_second / len(ready) * itl.mean


def rising(observation: Observation) -> bool:
    """Requests arrive faster than they finish by more than chance: the window's arrivals minus its
    completions exceed twice the Poisson spread of that difference (the root of their sum). A
    steady load passes it by chance about one window in 40; a burst's first seconds (2.8-4.2
    arrivals a second against 0.1-1.3 completions, live) pass it."""
    arrived, finished = _counts(observation)
    return arrived - finished > 2 * math.sqrt(arrived + finished)


def falling(observation: Observation) -> bool:
    """Requests finish faster than they arrive by more than chance (as `rising`, the other way): a
    backlog draining after a burst. Live (stop 40's bursts), the windows in which ITL cut the chunk
    at a burst's end had 0-0.7 requests a second arriving and 1.7-4.1 finishing."""
    arrived, finished = _counts(observation)
    return finished - arrived > 2 * math.sqrt(arrived + finished)


def _counts(observation: Observation) -> tuple[float, float]:
    """Requests that arrived and that finished in the window."""
    load, seconds = observation.load, observation.window_seconds
    return load.arrival_rate * seconds, load.completion_rate * seconds


def rates(observation: Observation) -> str:
    return f"{observation.load.arrival_rate:.2f} against {observation.load.completion_rate:.2f} a second"


def refused_share(observation: Observation) -> float:
    """The share of the window's requests refused with a 429 (admission full, or shed after
    limits.queue_timeout_seconds): each one missed its first token for good, whatever TTFT the
    served ones had (a queue limit short of the objective keeps those on time)."""
    load = observation.load
    offered = load.arrival_rate + load.rejected_rate  # a shed request was admitted: in arrival_rate already
    return (load.rejected_rate + load.shed_rate) / offered if offered > 0 else 0.0


def is_queueing(observation: Observation) -> bool:
    """Sequences wait for a place: in the front's queue or inside a worker."""
    return observation.load.queue_depth > 0 or any(w.waiting_sequences for w in observation.workers)


def ready_workers(observation: Observation):
    return [w for w in observation.workers if w.state == "ready"]


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"
