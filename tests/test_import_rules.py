"""Imports run one way (docs/ARCHITECTURE.md), and code stays in small pieces.

engine/ imports nothing from the other packages, monitors/ nothing either, policies/ only the
types they decide on; inside autotune/, the live server never imports the benchmark or the
offline tools, and the benchmark never imports the offline tools. No module imports itself
back through others. No file over 450 lines and no function over 60 outside benchmarks/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "monitors", "policies", "autotune")
SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool = False) -> list[str]:
    """Absolute module names a file imports (`from a import b` counts `a.b` when that is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
    return out


MODULES = {module_of(p) for p in SOURCES}
OURS = tuple(PACKAGES)


def ours(name: str) -> bool:
    return name.split(".")[0] in OURS


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("package", ["engine", "monitors"])
def test_engine_and_monitors_import_none_of_the_other_packages(package):
    bad = [(rel(p), name) for p in (ROOT / package).rglob("*.py") for name in imports(p) if ours(name) and not under(name, package)]
    assert not bad


ALLOWED = {"pydantic", "numpy", "scipy", "engine.config", "monitors.observation", "policies"}
FORBIDDEN_STDLIB = {"time", "datetime", "threading", "asyncio", "subprocess", "socket", "importlib"}


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.py")), ids=lambda p: p.name)
def test_policies_import_only_types_and_pure_libraries(path):
    """Policies never read a clock or touch the machine: `now` comes in with the Observation."""
    allowed_here = ALLOWED | ({"yaml"} if path.name == "loader.py" else set())
    for name in imports(path):
        root = name.split(".")[0]
        ok = any(under(name, a) for a in allowed_here) or (root in sys.stdlib_module_names and root not in FORBIDDEN_STDLIB)
        assert ok, f"{path.name} imports {name}"


LAYERS = {"live": {"live"}, "bench": {"live", "bench"}, "offline": {"live", "bench", "offline"}, "cluster": {"live", "cluster"}}
"""Inside autotune/, which layers each layer may import."""


def autotune_layer(module: str) -> str:
    for layer in ("bench", "offline", "cluster"):
        if under(module, f"autotune.{layer}"):
            return layer
    return "live"


def test_autotune_layers_run_one_way():
    """live (autotune/*.py) <- bench (autotune/bench) <- offline (autotune/offline), and live <-
    cluster (autotune/cluster, the Ray layer): the one-host server never imports Ray's side.
    cli.py wires them all (the cluster lazily, only for `serve --ray`)."""
    bad = []
    for path in (ROOT / "autotune").rglob("*.py"):
        module = module_of(path)
        if module == "autotune.cli":
            continue
        allowed = LAYERS[autotune_layer(module)]
        bad += [(module, n) for n in imports(path) if under(n, "autotune") and autotune_layer(n) not in allowed]
    assert not bad


def test_no_import_cycles():
    """Module-level imports form no cycle (a lazy import inside a function may close one on purpose)."""
    graph = {module_of(p): {n for n in imports(p, top_level_only=True) if n in MODULES} for p in SOURCES}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            if nxt != node and not under(node, nxt):  # a package's own __init__ is not a cycle
                visit(nxt, stack + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


SIZED = [p for p in SOURCES] + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SIZED, ids=rel)
def test_small_files_and_functions(path):
    text = path.read_text()
    assert text.count("\n") <= 450, f"{rel(path)} has {text.count(chr(10))} lines"
    long = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"{rel(path)}: functions over 60 lines: {long}"
