"""What every `selftune` command prints: progress on stderr, and with --json one JSON line on stdout."""

from __future__ import annotations

import json
import math
import sys


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=jsonable))


def jsonable(value):
    """json.dump's `default`: non-finite floats as null, arrays as lists, the rest as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def say(text: str = "") -> None:
    print(text, file=sys.stderr)
