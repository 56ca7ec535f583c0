"""EngineState: the one lifecycle of an engine, shared by `Engine` and its core loop."""

from __future__ import annotations

import enum


class EngineState(str, enum.Enum):
    CREATED = "created"
    """Constructed; nothing runs yet."""
    STARTING = "starting"
    """Loading the model, forking the first workers."""
    SERVING = "serving"
    """Takes requests."""
    CLOSING = "closing"
    """Takes no new requests; what is queued or running goes on."""
    STOPPED = "stopped"
    """Everything released (or the core stopped: the zygote died, the loop crashed)."""
