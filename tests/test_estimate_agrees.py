"""``autotune estimate`` and the search's planner predict the same peak for the same candidate.

Both go through :func:`autotune.candidate.estimate.estimate_for`; before, the CLI skipped
``as_trl`` and read ms-swift's ``sleep_level`` as no sleep mode at all (75.3 against the trial's
68.8 GiB on the swift example below). Compared here: the real CLI in a subprocess on that example,
and the command's own function against ``Planner.raw`` on candidates spread over two spaces.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
from conftest import run_cli

from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.commands.estimate import estimate_candidate
from autotune.commands.inputs import resolve_inputs
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.search.planner import Planner

ROOT = Path(__file__).resolve().parents[1]
SWIFT_SPACE = ROOT / "search_spaces" / "swift.yaml"
SWIFT_EXAMPLE = {
    "per_device_train_batch_size": "4",
    "gradient_accumulation_steps": "4",
    "num_generations": "8",
    "zero_stage": "3",
    "sleep_level": "1",
    "use_vllm": "true",
    "vllm_gpu_memory_utilization": "0.4",
}


def searched_recipe(model: str, gpus: int, gpu: str, space: Path | None, pins: dict[str, str]) -> Recipe:
    """The recipe ``autotune search`` builds from these flags (the simulator's runner: no GPU)."""
    recipe = Recipe(model=model, gpus=gpus, runner="sim", device="cuda", workdir=str(ROOT))
    resolve_inputs(recipe, gpu, None, space, pins)
    return recipe


def planned_gib(recipe: Recipe, params: dict) -> float:
    """What the search's planner predicts for ``params`` before any trial (uncalibrated)."""
    planner = Planner(resolve_model(recipe.model), recipe, find_gpu_type(recipe.gpu_type))
    return planner.predict(params)


def test_cli_estimate_and_the_search_agree_on_the_swift_example():
    flags = [f"--set={k}={v}" for k, v in SWIFT_EXAMPLE.items()]
    res = run_cli(
        "estimate", "--model", "Qwen2.5-7B", "--gpus", "4", "--gpu-type", "A100-80GB",
        "--space", SWIFT_SPACE, *flags, "--json",
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    printed = json.loads(res.stdout)
    recipe = searched_recipe("Qwen2.5-7B", 4, "A100-80GB", SWIFT_SPACE, SWIFT_EXAMPLE)
    space = load_space(SWIFT_SPACE)
    # the candidate as the search evaluates it: pins over the space's defaults, derived, normalized
    params = space.normalize(constraints.derive({**space.defaults(), **recipe.pins}, recipe))
    assert printed["params"] == params
    assert printed["total_gib"] == pytest.approx(planned_gib(recipe, params), abs=1e-3)


def valid_candidates(space, recipe: Recipe, k: int) -> list[dict]:
    """``k`` distinct valid candidates drawn from the space's grid values (seeded: the same each run)."""
    rng = random.Random(18)
    found: dict[str, dict] = {}
    for _ in range(200 * k):
        drawn = {name: rng.choice(p.grid_values(5)) for name, p in space.params.items()}
        cand = space.normalize(constraints.derive(drawn, recipe, space))
        if not constraints.violations(cand, recipe, space=space):
            found.setdefault(repr(sorted(cand.items())), cand)
        if len(found) == k:
            break
    return list(found.values())


@pytest.mark.parametrize(
    "model, gpus, gpu, space",
    [("Qwen2.5-1.5B", 1, "H100-80GB", None), ("Qwen2.5-7B", 4, "A100-80GB", SWIFT_SPACE)],
)
def test_the_estimate_command_and_the_planner_agree_on_many_candidates(model, gpus, gpu, space, capsys):
    recipe = searched_recipe(model, gpus, gpu, space, {})
    loaded = load_space(recipe.space)
    planner = Planner(resolve_model(model), recipe, find_gpu_type(recipe.gpu_type))
    candidates = valid_candidates(loaded, recipe, 16)
    assert len(candidates) == 16
    for cand in candidates:
        pins = {k: json.dumps(v) for k, v in cand.items() if k in loaded.params}
        estimate_candidate(dataclasses.replace(recipe, pins={}), True, pins)
        printed = json.loads(capsys.readouterr().out)
        assert printed["params"] == cand
        assert printed["total_gib"] == pytest.approx(planner.predict(cand), abs=1e-3), cand
