"""The benchmark's landscapes on the search's side: recipe, valid grid, ground truth, executors.

Imported by scripts/bench_search.py (and bench_parallel.py). The truth comes from autotune/sim
only; the search's internals used here are the space loader and TRL's validity rules (the grid of
the ``trl`` family is TRL's valid one; the other families' grids are their whole spaces, which
their trainers accept).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.candidate import constraints  # noqa: E402
from autotune.candidate.space_file import load_space  # noqa: E402
from autotune.hardware import find_gpu_type  # noqa: E402
from autotune.models import resolve_model  # noqa: E402
from autotune.progress import Reporter  # noqa: E402
from autotune.recipe import Recipe  # noqa: E402
from autotune.runners import TrialContext  # noqa: E402
from autotune.runners.sim import SimRunner  # noqa: E402
from autotune.sim.families import LandscapeDef, steady  # noqa: E402
from autotune.sim.landscape import evaluate  # noqa: E402
from autotune.sim.physics import Physics  # noqa: E402
from autotune.sim.replay import FamilyExecutor, TruthExecutor  # noqa: E402
from autotune.study import candidate_key  # noqa: E402

# The true value of a configuration averages its long runs over several seeds: with one seed the
# maximum over thousands of noisy values ("best possible") is inflated by the luckiest draw.
TRUTH_SEEDS = (7, 8, 9)


@dataclass(frozen=True)
class Case:
    """A fixed GRPO-simulator case with neutral physics (bench_parallel.py, test_planner.py)."""

    name: str
    model: str
    gpus: int
    gpu_type: str
    global_batch: int
    prompt: int = 512
    completion: int = 1024


CASES = [
    Case("Qwen2.5-7B, 4 x A100-80GB, batch 256", "Qwen2.5-7B-Instruct", 4, "A100-80GB", 256),
    Case("Llama-3.1-8B, 8 x H100-80GB, batch 512", "Llama-3.1-8B", 8, "H100-80GB", 512),
    Case("Qwen2.5-1.5B, 2 x RTX-4090 (24 GB), batch 128", "Qwen2.5-1.5B", 2, "RTX-4090", 128, 512, 512),
    Case("Llama-3.1-8B, 8 x A10G (24 GB), batch 256", "Llama-3.1-8B", 8, "A10G", 256),
]


def case_def(case: Case) -> LandscapeDef:
    recipe = dict(
        model=case.model,
        gpus=case.gpus,
        gpu_type=case.gpu_type,
        global_batch=case.global_batch,
        max_prompt_length=case.prompt,
        max_completion_length=case.completion,
        runner="sim",
    )
    return LandscapeDef(-1, "trl", case.name, Physics(), None, recipe)


class Quiet(Reporter):
    def emit(self, text: str) -> None:
        pass


@dataclass
class Landscape:
    """One landscape: its recipe, context, valid candidates and their true values."""

    case: LandscapeDef
    recipe: Recipe
    context: TrialContext
    candidates: list[dict[str, Any]]
    truth: dict[str, float] = field(default_factory=dict)
    safe: dict[str, float] = field(default_factory=dict)
    trial_equivalent_s: float = 0.0  # loading + 7 steps of the best configuration, simulated seconds
    # every trial measured without run-to-run or step-to-step noise and without transient crashes
    # (bench_search.py --exact): what the search reaches when its throughputs are exact (a run's memory
    # luck, creep and fragmentation, stays: the truth has it too)
    exact: bool = False
    # what autotune's planner is told by the truth itself (bench_search.py --oracle): "memory" skips
    # every configuration a long run of which dies or peaks inside the headroom, "prior" ranks by the
    # truth's own throughputs; bounds on what a perfect memory model or speed prior would buy
    oracle: frozenset[str] = frozenset()

    @property
    def best(self) -> float:
        return max(self.safe.values())

    def value(self, params: dict[str, Any] | None) -> float:
        if params is None:
            return 0.0
        key = candidate_key(params)
        if key not in self.truth:
            self.truth[key], self.safe[key] = true_value(self, params)
        return self.truth[key]

    def safe_value(self, params: dict[str, Any]) -> float:
        """Its value counted only when a long run also keeps the headroom free (0 otherwise)."""
        self.value(params)
        return self.safe[candidate_key(params)]

    def complete(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` as a configuration of the space: what it leaves out at the space's defaults, what
        a value it holds requires set (the planner also asks of partial configurations)."""
        space = self.context.space
        return space.normalize({**space.defaults(), **params})

    def executor(self, seed: int) -> Any:
        """The in-process executor of one search with this seed (transient crashes included, unless
        :attr:`exact`)."""
        d = steady(self.case) if self.exact else self.case
        if d.family == "trl":
            recipe = make_recipe(d, seed, self.recipe.trials)
            context = TrialContext(recipe, self.context.space, self.context.model, self.context.gpu)
            return TruthExecutor(SimRunner(context), d.physics)
        return FamilyExecutor(d.truth, d.env, d.program, seed, 0)


def make_recipe(d: LandscapeDef | Case, seed: int, trials: int) -> Recipe:
    d = case_def(d) if isinstance(d, Case) else d
    gpu = find_gpu_type(d.recipe["gpu_type"])
    space = load_space(d.space)
    return Recipe(
        **d.recipe,
        gpu_memory_gib=d.env.gpu_gib if d.env else gpu.memory_gib,
        trials=trials,
        seed=seed,
        space=str(space.path),
        space_digest=space.digest,
        name=f"bench-{seed}",
    )


def truth_of(land: Landscape, params: dict[str, Any], seed: int, steps: int) -> Any:
    """One run's truth on the landscape's steady physics (no transient crash)."""
    d = land.case
    if d.family == "trl":
        spec = SimRunner(land.context).build_spec(params, 0)
        spec.update(seed=seed, max_steps=steps, physics=d.physics.steady().to_json())
        return evaluate(spec)
    calm = steady(d)
    return d.truth(params, calm.env, seed, steps)


def true_value(land: Landscape, params: dict[str, Any]) -> tuple[float, float]:
    """Throughput of a long run averaged over the truth seeds (0 if any dies), and the same counted
    only when the run also kept the headroom free (what *best possible* is taken over)."""
    r = land.recipe
    values, peaks = [], []
    for seed in TRUTH_SEEDS:
        truth = truth_of(land, params, seed, r.warmup_steps + 3 * r.measure_steps)
        if truth.failure is not None:
            return 0.0, 0.0
        values.append(truth.throughput(r.warmup_steps) or 0.0)
        peaks.append(truth.peak_gib)
    value = sum(values) / len(values)
    return value, (value if max(peaks) <= r.gpu_memory_gib * (1 - r.headroom) else 0.0)


def grid(d: LandscapeDef, recipe: Recipe, space: Any) -> list[dict[str, Any]]:
    """The valid grid: TRL's rules for the GRPO simulator, the whole space for the others."""
    fixed = {"gradient_accumulation_steps": 0} if d.family == "trl" else {}
    seen: set[str] = set()
    out = []
    for cand in space.grid(fixed, float_points=15):
        if d.family == "trl":
            cand = constraints.derive(cand, recipe)
        cand = space.normalize(cand)
        key = candidate_key(cand)
        if key in seen or (d.family == "trl" and constraints.violations(cand, recipe)):
            continue
        seen.add(key)
        out.append(cand)
    return out


def build_landscape(d: LandscapeDef | Case, trials: int, exact: bool = False) -> Landscape:
    d = case_def(d) if isinstance(d, Case) else d
    recipe = make_recipe(d, 0, trials)
    space = load_space(d.space)
    gpu = find_gpu_type(d.recipe["gpu_type"])
    context = TrialContext(recipe=recipe, space=space, model=resolve_model(recipe.model), gpu=gpu)
    land = Landscape(d, recipe, context, grid(d, recipe, space), exact=exact)
    for cand in land.candidates:
        land.value(cand)
    best = max(land.candidates, key=lambda c: land.safe[candidate_key(c)])
    truth = truth_of(land, best, TRUTH_SEEDS[0], 7)
    land.trial_equivalent_s = truth.startup_s + sum(truth.step_times[:7])
    return land
