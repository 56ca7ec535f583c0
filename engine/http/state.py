"""What the HTTP layer holds besides the engine: its limits, admission and knob pins."""

from __future__ import annotations

import collections
import hmac
import os
from dataclasses import dataclass, field
from typing import Callable

from engine.engine import Engine
from engine.http.limits import Admission


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_items_per_request: int = 256
    """Inputs in one embeddings request."""
    max_body_bytes: int = 4 * 1024 * 1024
    max_queued_requests: int = 512
    """Requests in the server at once; more are answered 429 with Retry-After."""
    max_queued_tokens: int | None = 200_000
    """Generation: prompt + max_tokens of all requests in the server at once; more: 429."""
    request_timeout: float = 60.0
    """Seconds before a request is answered 504 and its queued work is dropped."""
    default_max_tokens: int = 16
    retry_after_seconds: int = 1


@dataclass(slots=True)
class ServerState:
    engine: Engine
    limits: ServerLimits
    admin_token_env: str = "SELFTUNE_ADMIN_TOKEN"
    served_names: tuple[str, ...] = ()
    """Names requests may use for the model (model.served_names); empty: the model's own."""
    pinned: set[str] = field(default_factory=set)
    """Knobs set through the admin API; autotuning leaves them alone."""
    admission: Admission = field(init=False)
    draining: bool = False
    timed_out: int = 0
    """Requests answered 504 so far."""
    observe: Callable[[], dict | None] | None = None
    """The latest Observation as a dict, when monitors are wired in (shown in /stats)."""
    decisions: Callable[[int], list[dict]] | None = None
    """The autotuner's recent decisions, when it runs (GET /admin/decisions)."""
    reload_policy: Callable[[], str] | None = None
    """Re-read the policy file; raises ValueError with a message for a bad file."""
    admin_changes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    """Knob changes made through the admin API, as decision-log entries (the dashboard shows them)."""

    def __post_init__(self):
        self.admission = Admission(self.limits.max_queued_requests, self.limits.max_queued_tokens)

    @property
    def admin_token(self) -> str | None:
        token = os.environ.get(self.admin_token_env)
        return token or None

    def admin_token_matches(self, presented: str) -> bool:
        token = self.admin_token
        return token is not None and hmac.compare_digest(token.encode(), presented.encode())
