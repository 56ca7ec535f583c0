"""What a user's install gets: the shipped configs as package data, how names find files, the
version, `selftune config show`, and every script under benchmarks/ still runs."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from autotune import shipped
from autotune.settings import DEFAULT_CONFIG, ConfigError, effective_config, load_config

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def selftune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_every_package_folder_is_listed_for_the_wheel():
    skip = {".venv", "tests", "build", ".git", "benchmarks", "scripts", "docs"}
    on_disk = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in skip or rel.parts[0].startswith("."):
            continue
        on_disk.add(".".join(("autotune",) + rel.parts if rel.parts[0] == "configs" else rel.parts))
    assert on_disk <= set(PYPROJECT["packages"]), f"not in pyproject's packages: {on_disk - set(PYPROJECT['packages'])}"
    assert PYPROJECT["package-dir"] == {"autotune.configs": "configs"}


def test_every_shipped_file_matches_the_package_data():
    data = PYPROJECT["package-data"]
    shipped_files = [p for p in (ROOT / "configs").rglob("*") if p.is_file() and p.suffix in (".yaml", ".json")]
    assert len(shipped_files) >= 10
    for path in shipped_files:
        rel = path.parent.relative_to(ROOT / "configs")
        package = ".".join(("autotune", "configs") + rel.parts)
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in data.get(package, [])), f"{path} would not ship"


def shown(text: str) -> dict[str, str]:
    """`config show`'s lines by "section.key"."""
    lines, section = {}, None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if not line.startswith(" "):
            section = line.rstrip(":")
        else:
            lines[f"{section}.{line.split(':')[0].strip()}"] = line
    return lines


def test_builtin_names_find_the_shipped_files():
    assert shipped.resolve("builtin:aimd", shipped.POLICY) == shipped.root() / "policies" / "aimd.yaml"
    assert shipped.resolve("builtin:default", shipped.CONFIG) == DEFAULT_CONFIG
    assert "epyc-2core-minilm" in shipped.names(shipped.COST_MODEL)
    assert {"default", "static", "aimd", "slo", "threshold", "composite", "search"} <= set(shipped.names(shipped.POLICY))
    with pytest.raises(FileNotFoundError) as err:
        shipped.resolve("builtin:nope", shipped.POLICY)
    assert "builtin:aimd" in err.value.strerror and err.value.filename == "builtin:nope"


def test_a_users_own_file_wins_and_configs_paths_fall_back_to_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # no configs/ here: the docs' spelling finds the shipped file
    assert shipped.resolve("configs/policies/aimd.yaml", shipped.POLICY) == shipped.root() / "policies" / "aimd.yaml"
    # the user's own file of that path wins, relative to the current directory
    own = tmp_path / "configs" / "policies" / "aimd.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("kind: static\n")
    assert shipped.resolve("configs/policies/aimd.yaml", shipped.POLICY).resolve() == own
    # anything else stays the path it is, for the caller's own "cannot read"
    assert shipped.resolve("mine.yaml", shipped.POLICY) == Path("mine.yaml")


def test_config_policy_key_takes_builtin_names_and_rejects_unknown_ones(tmp_path):
    config = load_config(None, {"autotune.policy": "builtin:slo"})
    assert config.autotune.policy_path() == shipped.root() / "policies" / "slo.yaml"
    with pytest.raises(ConfigError, match="autotune.policy: builtin:nope: no shipped policy"):
        load_config(None, {"autotune.policy": "builtin:nope"})
    # with autotuning off the policy is never read, so it is not checked
    assert not load_config(None, {"autotune.policy": "builtin:nope", "autotune.enabled": False}).autotune.enabled


def test_the_default_policy_follows_the_task():
    policies = shipped.root() / "policies"
    assert load_config(None).autotune.policy_path() == policies / "default.yaml"
    assert load_config(None, {"model.task": "generate"}).autotune.policy_path() == policies / "generate.yaml"
    chosen = load_config(None, {"model.task": "generate", "autotune.policy": "builtin:slo"})
    assert chosen.autotune.policy_path() == policies / "slo.yaml"  # a policy named is kept whatever the task


def test_config_show_gives_a_file_that_loads_to_the_same_config(tmp_path):
    overrides = {"concurrency.process_count": 3, "model.task": "generate"}
    text = effective_config(None, overrides)
    lines = shown(text)
    assert lines["concurrency.process_count"].endswith("# command line")
    assert lines["bounds.process_count"].endswith("# builtin:default")
    assert lines["server.host"].endswith("# builtin:default")
    mine = tmp_path / "mine.yaml"
    mine.write_text(text)
    assert load_config(mine) == load_config(None, overrides)
    # a file of the user's: its keys say so, the rest are defaults
    small = tmp_path / "small.yaml"
    small.write_text("server:\n  port: 8123\n")
    lines = shown(effective_config(small))
    assert lines["server.port"] == f"  port: 8123   # {small}"
    assert lines["server.host"].endswith("# default")
    assert yaml.safe_load(effective_config(small))["server"]["port"] == 8123


def test_cli_version_and_config_show_from_another_directory(tmp_path):
    out = selftune("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"selftune {importlib.metadata.version('selftune')}"
    out = selftune("config", "show", "--workers", "2", "--policy", "configs/policies/slo.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "  process_count: 2   # command line" in out.stdout
    assert "  policy: configs/policies/slo.yaml   # command line" in out.stdout
    bad = selftune("config", "show", "--config", "nope.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "nope.yaml: cannot read the config file" in bad.stderr


def test_simulate_finds_the_shipped_policy_and_cost_model_from_another_directory(tmp_path):
    out = selftune("simulate", "--workload", "poisson:rate=5,duration=10", "--policy", "builtin:aimd", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"policy": "builtin:aimd"' in out.stdout.splitlines()[-1]
    bad = selftune("simulate", "--workload", "poisson:rate=5,duration=10", "--cost-model", "builtin:nope", cwd=tmp_path)
    assert bad.returncode == 2 and "builtin:epyc-2core-minilm" in bad.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_bench_script_imports_and_answers_help(script):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert script in out.stdout or "python benchmarks/" in out.stdout


def test_the_wheel_carries_the_configs(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("selftune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "configs").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json"):
            assert f"autotune/configs/{path.relative_to(ROOT / 'configs')}" in names
    assert "autotune/shipped.py" in names and "engine/http/app.py" in names and "autotune/dashboard.html" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "configs/")) for n in names)
