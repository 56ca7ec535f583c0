"""The offline tuner: search a policy's parameters in the simulator, and the best static knobs.

Every candidate is scored by simulating every workload (seeded, so the same candidate always
scores the same) and averaging the objective over them:

    goodput            requests finished within the SLO per second (maximised)
    slo_attainment     share of requests finished within the SLO (maximised)
    cost_per_request   core-seconds held per good request (minimised; cores = processes × threads)

Policy parameters are named by their path in the policy spec (`target`, or
`members.0.policy.target` inside a composite), each with [low, high] bounds for the scipy
optimizers (integers when both bounds are) or a list of values for the grid. The best static
configuration (an exhaustive grid over the knobs: the "oracle") is always reported beside it,
and for `kind: static` it is the answer.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import yaml

from autotune.offline.costmodel import CostModel
from autotune.offline.gen_simulator import GenSimConfig, simulate_generation
from autotune.offline.simulator import SimConfig, simulate
from engine.config import Knobs
from policies.loader import policy_from_spec

OBJECTIVES = {"goodput": 1.0, "slo_attainment": 1.0, "cost_per_request": -1.0}
"""Objective -> sign: the tuner maximises sign × value."""

DEFAULT_SPACES = {
    "threshold": {"target": [0.4, 0.95], "tolerance": [0.0, 0.3], "scale_down_stabilization_seconds": [0, 60]},
    "aimd": {"additive_step": [1, 8], "decrease_factor": [0.3, 0.95], "fill_threshold": [0.5, 1.0], "cooldown_seconds": [0, 20]},
    "slo": {"budget_fraction": [0.2, 1.0], "headroom": [0.0, 1.0]},
    "search": {"settle_seconds": [2, 20], "trial_seconds": [4, 40], "min_improvement": [0.0, 0.2]},
    "generate": {"headroom": [0.3, 1.0], "growth_step": [1, 8], "decrease_factor": [0.5, 0.9], "fill_threshold": [0.5, 1.0]},
}

DEFAULT_STATIC_GRID = {
    "process_count": [1, 2],
    "threads_per_process": [1, 2],
    "max_batch_size": [1, 2, 4, 8, 16, 32],
    "batch_timeout": [0.0, 0.005, 0.02],
}


@dataclass
class Problem:
    """What to tune and how to score it."""

    spec: dict
    """The policy spec (kind + parameters) as a policy file holds it."""
    workloads: list
    """Arrival lists (already generated)."""
    cost_model: CostModel
    sim: SimConfig
    objective: str = "goodput"
    space: dict = field(default_factory=dict)
    """Parameter path -> [low, high] (optimizers) or list of values (grid)."""


def score(problem: Problem, spec: dict | None, knobs: Knobs | None = None) -> tuple[float, dict]:
    """(sign × mean objective over the workloads, the mean metrics); spec None = static."""
    sim = problem.sim if knobs is None else replace(problem.sim, knobs=knobs)
    metrics = {"goodput": [], "slo_attainment": [], "cost_per_request": [], "p99": []}
    for arrivals in problem.workloads:
        policy = policy_from_spec(spec, "tune candidate") if spec is not None else None
        run = simulate_generation if isinstance(sim, GenSimConfig) else simulate  # a generation problem's sim is a GenSimConfig
        summary = run(arrivals, problem.cost_model, sim, policy).summary()
        for key in ("goodput", "slo_attainment", "cost_per_request"):
            metrics[key].append(summary[key])
        metrics["p99"].append(summary["latency_seconds"]["p99"])
    mean = {k: float(np.mean(v)) for k, v in metrics.items()}
    value = mean[problem.objective]
    signed = OBJECTIVES[problem.objective] * value
    return (signed if math.isfinite(signed) else -1e18), mean


def set_path(spec: dict, path: str, value) -> dict:
    """A copy of spec with `a.0.b` set to value."""
    out = copy.deepcopy(spec)
    node = out
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


def _is_int_range(bounds) -> bool:
    return all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)


def candidate(spec: dict, space: dict, vector) -> dict:
    for (path, bounds), x in zip(space.items(), vector):
        spec = set_path(spec, path, int(round(x)) if _is_int_range(bounds) else float(x))
    return spec


def tune_policy(problem: Problem, method: str = "differential_evolution", maxiter: int = 10, popsize: int = 5, seed: int = 0, progress=None) -> dict:
    """Search the policy parameters; returns the best spec, its score and the shipped spec's."""
    from scipy.optimize import differential_evolution, minimize

    space = problem.space or DEFAULT_SPACES.get(problem.spec.get("kind"), {})
    if not space:
        raise ValueError(f"policy kind {problem.spec.get('kind')!r}: give the parameters to search (search.params)")
    problem.space = space
    seen: dict[tuple, float] = {}
    history: list[dict] = []

    def evaluate(vector) -> float:
        spec = candidate(problem.spec, space, vector)
        key = tuple(sorted(_flat(spec)))
        if key not in seen:
            value, mean = score(problem, spec)
            seen[key] = value
            history.append({"params": {p: get_path(spec, p) for p in space}, "score": value, **mean})
            if progress is not None:
                progress.update(1)
        return -seen[key]

    baseline_value, baseline_metrics = score(problem, problem.spec)
    if method == "grid":
        for combo in itertools.product(*space.values()):
            evaluate(combo)
    else:
        bounds = [tuple(map(float, b)) for b in space.values()]
        integrality = [_is_int_range(b) for b in space.values()]
        if method == "differential_evolution":
            differential_evolution(evaluate, bounds, seed=seed, maxiter=maxiter, popsize=popsize, polish=False, integrality=integrality, tol=1e-6)
        elif method == "nelder-mead":
            x0 = [min(max(get_path(problem.spec, p, (lo + hi) / 2), lo), hi) for p, (lo, hi) in zip(space, bounds)]
            minimize(evaluate, x0, method="Nelder-Mead", bounds=bounds, options={"maxfev": maxiter * popsize * len(space), "xatol": 1e-3, "fatol": 1e-6})
        else:
            raise ValueError(f"search method {method!r}: expected differential_evolution, nelder-mead or grid")
    best = max(history, key=lambda h: h["score"]) if history else None
    if best is None or best["score"] <= baseline_value:
        best_spec, best_value = problem.spec, baseline_value  # nothing beat the shipped parameters: keep them
    else:
        best_spec, best_value = candidate(problem.spec, space, [best["params"][p] for p in space]), best["score"]
    return {
        "spec": best_spec,
        "score": OBJECTIVES[problem.objective] * best_value,
        "baseline_score": OBJECTIVES[problem.objective] * baseline_value,
        "baseline_metrics": baseline_metrics,
        "evaluations": len(history),
        "history": history,
    }


def static_grid(grid: dict, base: Knobs, sim: SimConfig) -> list[Knobs]:
    """Every knob combination of the grid that the guardrails would allow on these cores."""
    names = list(grid)
    out = []
    for values in itertools.product(*grid.values()):
        knobs = base.replace(**dict(zip(names, values)))
        if not sim.allow_oversubscription and knobs.process_count * knobs.threads_per_process > sim.cores:
            continue
        out.append(sim.bounds.validate(knobs))
    return out


def oracle(problem: Problem, grid: dict | None = None, progress=None) -> dict:
    """The best static knobs: every grid point simulated with the knobs held (no controller)."""
    results = []
    for knobs in static_grid(grid or DEFAULT_STATIC_GRID, problem.sim.knobs, problem.sim):
        value, mean = score(problem, None, knobs)
        results.append({"knobs": knobs.as_dict(), "score": value, **mean})
        if progress is not None:
            progress.update(1)
    results.sort(key=lambda r: -r["score"])
    best = results[0]
    return {"knobs": best["knobs"], "score": OBJECTIVES[problem.objective] * best["score"], "metrics": {k: best[k] for k in ("goodput", "slo_attainment", "cost_per_request", "p99")}, "grid": results}


def write_policy(spec: dict, path: str, header: str) -> None:
    """The tuned spec as a policy file (`policies.loader.load_policy` reads it unchanged)."""
    lines = "".join(f"# {line}\n" for line in header.splitlines())
    with open(path, "w", encoding="utf-8") as f:
        f.write(lines + yaml.safe_dump(spec, sort_keys=False))


def write_knobs(knobs: dict, path: str, header: str) -> None:
    """Static knobs as the server config's `concurrency:` section."""
    lines = "".join(f"# {line}\n" for line in header.splitlines())
    with open(path, "w", encoding="utf-8") as f:
        f.write(lines + yaml.safe_dump({"concurrency": knobs}, sort_keys=False))


def get_path(spec: dict, path: str, default=None):
    node = spec
    for part in path.split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError):
            return default
    return node


def _flat(spec, prefix: str = ""):
    if isinstance(spec, dict):
        for k, v in spec.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(spec, list):
        for i, v in enumerate(spec):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield (prefix, repr(spec))


def progress_bar(total: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sim", file=sys.stderr)
