"""Front-side request objects: what callers hold while the engine works on their request."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.batcher import Item
from engine.sampling import SamplingParams, TokenLogprobs


class EngineError(RuntimeError):
    """Base of the errors a request can end with."""


class EngineClosed(EngineError):
    """The engine is shutting down (or has) and takes no more work."""


class WorkerLost(EngineError):
    """The worker died after this generation had already streamed tokens; it cannot be re-run."""


class ModelFailed(EngineError):
    """The model raised on this input."""


class QueueTimeout(EngineError):
    """The request waited its queue limit for a worker and was refused before it ran (overload)."""


class InputTooLong(ValueError):
    """An input has more tokens than the model (or the configured limit) accepts."""


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where a request's time went, in seconds (for response headers and the monitors)."""

    preprocess: float
    queue: float
    model: float
    total: float
    batch: tuple[int, int, int] = (0, 0, 0)
    """The slowest batch the request ran in: (items, rows, tokens per row); rows < items when
    it ran packed. The simulator's calibration reads it."""


@dataclass(frozen=True, slots=True)
class EmbedResult:
    vectors: np.ndarray
    """(n, hidden) float32, L2-normalised."""
    prompt_tokens: int
    timings: RequestTimings


@dataclass(slots=True)
class EmbedJob:
    request_id: int
    future: Future
    vectors: np.ndarray
    remaining: int
    prompt_tokens: int
    created: float
    submitted: float
    first_dispatch: float | None = None
    model_seconds: float = 0.0
    batch: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    finish_reason: str | None
    """None while generating; "stop", "length" or "abort" on the last event."""
    logprobs: TokenLogprobs | None = None


class TokenStream:
    """The tokens of one generation as they are produced; iterate it, or set `on_event`.

    Events are TokenEvent, or an EngineError that ends the stream.
    """

    def __init__(self, request_id: int, prompt_tokens: int = 0):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.on_event: Callable[[object], None] | None = None

    def put(self, event) -> None:
        callback = self.on_event
        if callback is not None:
            callback(event)
        else:
            self._events.put(event)

    def get(self, timeout: float | None = None):
        return self._events.get(timeout=timeout)

    def __iter__(self):
        while True:
            event = self._events.get()
            if isinstance(event, Exception):
                raise event
            yield event
            if event.finish_reason is not None:
                return


@dataclass(slots=True)
class GenerateJob:
    request_id: int
    item: Item
    stream: TokenStream
    created: float
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    emitted: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    worker_id: int | None = None
    batch_id: int | None = None
