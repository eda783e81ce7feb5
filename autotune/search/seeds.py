"""The first trials of a study: the candidates the search starts from.

With a usable memory model (GPU trials) the seeds are the candidates the model expects to fit with
room to spare and the speed prior ranks fastest, the best of each region first (a ZeRO stage with
each combination of the values of knobs whose effect on memory the model does not know: the prior
cannot rank those, and a PPO trainer's colocated models at ZeRO-3 are another landscape than at
ZeRO-2), so that one wrong guess of the prior does not sink them all. Seeds spread further (each
differing from every other in at least two knobs) were measured and lost: 67% of the benchmark's
runs at 0.95 of the best against 73% (docs/benchmarks-notes.md). Without a model (CPU trials) the
seeds are hand-written starting points that find the memory boundary at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.recipe import Recipe
from autotune.search.planner import Planner

SEEDS = 4  # seed trials per study
SEED_MARGIN = 0.05  # seeds leave this much of the GPU free beyond the headroom (at least as much)

Rules = Sequence[Callable[[dict[str, Any]], "str | None"]]


def seed_candidates(
    planner: Planner | None, space: Space, recipe: Recipe, fixed: dict[str, Any], rules: Rules
) -> list[dict[str, Any]]:
    """Model-ranked seeds when the memory model can rank, else the hand-written ones."""
    if planner is not None and planner.use_model:
        ranked = model_seeds(planner, space, fixed, rules, k=SEEDS)
        if ranked:
            return ranked
    return fallback_seeds(space, recipe, fixed, rules)


def model_seeds(
    planner: Planner, space: Space, fixed: dict[str, Any], rules: Rules, k: int = SEEDS
) -> list[dict[str, Any]]:
    """The k valid candidates the model expects to fit with headroom and the prior ranks fastest:
    the best per region (ZeRO stage and the values of the knobs of unknown memory effect), then the
    rest by prior; fastest by prior first."""
    recipe = planner.recipe
    limit = recipe.gpu_memory_gib * (1 - max(recipe.headroom, SEED_MARGIN) - SEED_MARGIN)
    pool = planner.pool(space, fixed, rules)
    scored = [
        cand
        for (_score, cand), (raw_gib, vllm_fails) in zip(pool, planner.sizes(pool))
        # before any peak is measured (no corrections yet) the prediction is the raw estimate
        if not (vllm_fails or (planner.predict(cand) if planner.weights else raw_gib) > limit)
    ]
    picked: list[dict[str, Any]] = []
    regions: set[Any] = set()
    for cand in scored:  # the best per region
        if len(picked) >= k:
            break
        region = (cand.get("zero_stage"), planner.knobs.split(cand)[1])
        if region not in regions:
            regions.add(region)
            picked.append(cand)
    for cand in scored:  # then the rest by prior
        if len(picked) >= k:
            break
        if cand not in picked:
            picked.append(cand)
    picked.sort(key=lambda c: -planner.prior(c))
    return picked


def fallback_seeds(space: Space, recipe: Recipe, fixed: dict[str, Any], rules: Rules) -> list[dict[str, Any]]:
    """Hand-tuned starting points for when the memory model cannot rank (CPU trials): the space's
    defaults, the largest micro-batch (it finds the memory boundary at once, and dominance then
    rules out everything above it), a conservative ZeRO-3 and a memory-lean offload, made valid by
    choosing accumulation."""
    defaults = space.defaults()
    micro = space.batch.micro_batch if space.batch is not None else "per_device_train_batch_size"
    accumulation = space.batch.accumulation if space.batch is not None else "gradient_accumulation_steps"
    largest = max(space.params[micro].grid_values()) if micro in space.params else None
    ideas = [
        {},
        {micro: largest, "gradient_checkpointing": True},
        {micro: 2, "zero_stage": 3, "offload": "none", "gradient_checkpointing": True},
        {micro: 1, "zero_stage": 3, "offload": "optimizer", "gradient_checkpointing": True},
    ]
    seeds: list[dict[str, Any]] = []
    for idea in ideas:
        base = {
            **defaults,
            **{k: v for k, v in idea.items() if k in space.params and space.params[k].contains(v)},
            **fixed,
        }
        choices = [base.get(accumulation)] if accumulation is not None else [None]
        if accumulation in space.params and accumulation not in fixed:
            choices += list(space.params[accumulation].grid_values())
        for value in choices:
            with_accumulation = {**base, accumulation: value} if accumulation in space.params else base
            cand = space.normalize(constraints.derive(with_accumulation, recipe))
            if not constraints.violations(cand, recipe, rules):
                if cand not in seeds:
                    seeds.append(cand)
                break
    return seeds
