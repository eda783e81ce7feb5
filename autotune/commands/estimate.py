"""``autotune estimate``: the memory model's prediction for one candidate, part by part.

A what-if calculator: the pins may hold any value of a parameter's type, also outside the space (a
warning says so); a wrong type, an unknown name or a candidate TRL refuses is bad input.
:func:`estimate_of` builds an :class:`Estimated`; :func:`render_json` and :func:`render_table` print it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.estimate import estimate_for
from autotune.candidate.memory import TYPICAL_REL_ERROR, Estimate
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError
from autotune.models import resolve_model
from autotune.progress import short_params
from autotune.recipe import Recipe


@dataclass
class Estimated:
    """One candidate's predicted peak per GPU, with what the user should know about it."""

    recipe: Recipe
    params: dict[str, Any]  # the candidate: the space's defaults, the pins, derived values
    estimate: Estimate
    warnings: list[str]  # pins outside the space

    @property
    def spread_gib(self) -> float:
        """The model's typical error, in GiB, around this prediction."""
        return TYPICAL_REL_ERROR * self.estimate.total_gib


def estimate_candidate(recipe: Recipe, as_json: bool, raw_pins: dict[str, str] | None = None) -> bool:
    """Print the memory model's breakdown for the pinned candidate (defaults for the rest), the
    verdict and the model's typical error; True when it fits."""
    result = estimate_of(recipe, raw_pins or {})
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if as_json:
        render_json(result)
    else:
        render_table(result)
    return result.estimate.fits


def estimate_of(recipe: Recipe, raw_pins: dict[str, str]) -> Estimated:
    """The candidate the recipe's pins and ``raw_pins`` describe, checked, and its estimate."""
    space = load_space(recipe.space or None)
    warnings = constraints.pin(recipe, space, raw_pins, what_if=True)
    model = resolve_model(recipe.model)
    params = constraints.derive({**space.defaults(), **recipe.pins}, recipe)
    params = space.normalize(params)
    broken = constraints.violations(params, recipe)
    if broken:
        raise UsageError(f"this candidate cannot run (TRL or DeepSpeed refuses it): {broken[0]}")
    est = estimate_for(model, recipe, params, space)
    return Estimated(recipe, params, est, warnings)


def render_json(result: Estimated) -> None:
    print(
        json.dumps(
            {
                **result.estimate.to_json(),
                "params": result.params,
                "typical_rel_error": TYPICAL_REL_ERROR,
                "warnings": result.warnings,
            },
            indent=2,
        )
    )


def render_table(result: Estimated) -> None:
    from rich.console import Console
    from rich.table import Table

    est, recipe, spread = result.estimate, result.recipe, result.spread_gib
    uncertainty = (
        f"uncertainty +/-{TYPICAL_REL_ERROR:.0%} (+/-{spread:.1f} GiB): it read 2-5% above 5 peaks "
        "measured on one H100 (Qwen2.5-1.5B, no vLLM); untested on other models, GPU counts, vLLM"
    )
    table = Table()
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for name, value in est.parts.items():
        table.add_row(name.replace("_", " "), f"{value:.2f}")
    if est.generation_sequences:
        table.add_row(f"generate() ({est.generation_sequences} seqs)", f"{est.generation_gib:.2f}")
    table.add_row(f"total ({est.phase} peak)", f"{est.total_gib:.2f}", style="bold")
    table.add_row("capacity", f"{est.capacity_gib:.2f}")
    console = Console(width=120)
    console.print(f"{recipe.model} on {recipe.gpus} x {recipe.gpu_type}: predicted peak memory per GPU")
    console.print(table)
    console.print(short_params(result.params))
    verdict = "fits" if est.fits else "does NOT fit"
    console.print(
        f"{verdict}: {est.total_gib:.1f} of {est.capacity_gib:.1f} GiB"
        + (f" ({est.total_gib / est.capacity_gib:.0%})" if est.capacity_gib else "")
        + f", {uncertainty}"
    )
    if est.fits and est.total_gib + spread > est.capacity_gib:
        console.print("- within the model's typical error of capacity: it may not fit")
    for note in est.notes:
        console.print(f"- {note}")
