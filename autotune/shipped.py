"""The configs that ship inside selftune (package data), and how a name on the command line finds one.

A value names a file in one of three ways, tried in this order:
  - `builtin:NAME`: the shipped file of that kind (`builtin:aimd` is the shipped aimd policy);
  - a path: absolute, or relative to the current directory, as users expect; their files win;
  - a shipped path as the checkout spells it (`configs/policies/aimd.yaml`), when no such file is
    in the current directory: what the docs show then works from an installed wheel too.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

BUILTIN = "builtin:"


@dataclass(frozen=True)
class Kind:
    """One kind of shipped file: what users call it, its folder under configs/, its suffix."""

    name: str
    folder: str
    suffix: str


CONFIG = Kind("config", "", ".yaml")
POLICY = Kind("policy", "policies", ".yaml")
COST_MODEL = Kind("cost model", "costmodels", ".json")
TUNE_CONFIG = Kind("tune config", "tune", ".yaml")
CLUSTER_POLICY = Kind("cluster policy", "cluster", ".yaml")


def root() -> Path:
    """The folder of shipped configs: configs/ in a checkout, autotune/configs in a wheel."""
    return Path(str(files("autotune.configs")))


def builtin(kind: Kind, name: str) -> Path:
    return root() / kind.folder / f"{name}{kind.suffix}"


def names(kind: Kind) -> list[str]:
    """The shipped files of a kind, by the NAME that `builtin:NAME` takes."""
    return sorted(p.name[: -len(kind.suffix)] for p in (root() / kind.folder).glob(f"*{kind.suffix}"))


def resolve(value: str | Path, kind: Kind) -> Path:
    """The file a command-line or config value names; an unknown `builtin:` raises FileNotFoundError
    whose strerror lists what ships. A path that does not exist comes back as it is, for the
    caller's own "cannot read" error."""
    text = str(value)
    if text.startswith(BUILTIN):
        path = builtin(kind, text[len(BUILTIN):])
        if not path.is_file():
            shipped = ", ".join(BUILTIN + n for n in names(kind))
            raise FileNotFoundError(errno.ENOENT, f"no shipped {kind.name} of that name (shipped: {shipped})", text)
        return path
    path = Path(text).expanduser()
    if path.is_absolute() or path.exists():
        return path
    if path.parts[:1] == ("configs",):
        candidate = root().joinpath(*path.parts[1:])
        if candidate.is_file():
            return candidate
    return path
