"""Moves in the search space: the candidates one or two knobs away from a configuration.

The local search around the incumbent and the walk toward feasibility both step through these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.recipe import Recipe


def knobs_apart(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many knobs two configurations differ in."""
    return sum(1 for k in set(a) | set(b) if a.get(k) != b.get(k))


def neighbors(
    params: dict[str, Any],
    space: Space,
    fixed: dict[str, Any],
    recipe: Recipe,
    rules: Iterable[Callable[[dict[str, Any]], str | None]] = (),
) -> list[dict[str, Any]]:
    """Valid candidates one or two knobs away from ``params`` (the next choice up or down, a
    flipped switch, the vLLM fraction one or two steps away), for a local search around the
    incumbent. Pairs matter: trading memory between knobs (drop offload, turn on checkpointing)
    is how the fastest configurations are reached from a good one."""
    rules = list(rules)
    full = {**space.defaults(), **params}
    moves = _single_moves(full, space, fixed)
    out: list[dict[str, Any]] = []
    combos = [dict([m]) for m in moves]
    combos += [dict([a, b]) for i, a in enumerate(moves) for b in moves[i + 1 :] if a[0] != b[0]]
    for change in combos:
        cand = space.normalize(constraints.derive({**full, **change}, recipe))
        if (
            cand != space.normalize(full)
            and not constraints.violations(cand, recipe, rules)
            and cand not in out
        ):
            out.append(cand)
    return out


def _single_moves(full: dict[str, Any], space: Space, fixed: dict[str, Any]) -> list[tuple[str, Any]]:
    moves: list[tuple[str, Any]] = []
    for name, param in space.params.items():
        if name in fixed or not space.relevant(name, full):
            continue
        value = full[name]
        options: list[Any] = []
        if param.choices is not None:
            choices = list(param.choices)
            if value in choices:
                i = choices.index(value)
                options = [choices[j] for j in (i - 1, i + 1) if 0 <= j < len(choices)]
        elif param.step:
            options = [round(value + d * param.step, 6) for d in (-2, -1, 1, 2)]
            options = [v for v in options if param.contains(v)]
        moves += [(name, option) for option in options]
    return moves
