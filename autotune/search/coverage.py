"""Every value of a switch or category nothing describes is measured once before the search settles.

The walk's rankings read two things: the memory model (or a declared direction) and the speed prior.
A switch or category that neither reads (NeMo-RL's ``recompute_granularity``: full or selective; a
PPO trainer's ``colocate_all_models``) ties with the incumbent in every ranking, so whether its other
value pays is left to the turn the rotation of knobs happens to give it, after momentum, trades and
co-leaders have had theirs. On the NeMo-RL-style family, 39 of seed 0's 86 searches below 0.95 of
the best never ran the selective recomputation that the good configuration nearest their export held
(docs/benchmarks-notes.md, forty-seventh pass). What nothing predicts must be measured: each such
value is run once, from the incumbent (what the value requires set with it), and a search does not
stop as converged while one of them is still open. A value is settled once a trial holding it ran, or
after :data:`ATTEMPTS` launched trials holding it ran out of memory or crashed (a value that cannot
run must not hold the search open). Integer knobs are left to the walk's steps, which move them up and
down by one value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import optuna

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.recipe import Recipe
from autotune.search.planner import Planner
from autotune.search.state import tried, walk_from
from autotune.study import TrialRow, candidate_key, rows

ATTEMPTS = 2  # launched trials of a value that did not run (OOM, crash) before it is settled unrun


def unread(planner: Planner, space: Space, fixed: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """The searched switches and categories that, where what each requires holds (``params`` with its
    ``requires:`` set), neither the memory side (the model, a declared, built-in or learned direction)
    nor the speed prior reads, in the space's order. One whose requirement a pin forbids is not
    searched there."""
    out = []
    for name, param in space.params.items():
        if name in fixed or param.type not in ("bool", "categorical") or not param.choices:
            continue
        if any(k in fixed and fixed[k] != v for k, v in param.requires.items()):
            continue
        at = {**params, **param.requires}
        if planner.knobs.direction(name, {**at, name: param.default}) is not None:
            continue
        priors = {planner.prior({**at, name: value}) for value in param.choices}
        if max(priors) - min(priors) <= 1e-9 * max(max(priors), 1e-9):
            out.append(name)
    return out


def open_value(
    planner: Planner,
    incumbent: dict[str, Any],
    space: Space,
    fixed: dict[str, Any],
    rules: Iterable[Callable[[dict[str, Any]], str | None]],
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
    launched: Iterable[tuple[dict[str, Any], str]],
) -> dict[str, Any] | None:
    """The incumbent with one such knob set to a value not yet settled (``launched``: each launched
    trial's parameters and status), best expected first; None when every value is settled or every
    candidate that would run one is tried or ruled out."""
    rules, launched = list(rules), list(launched)
    options = []
    for name in unread(planner, space, fixed, incumbent):
        for value in space.params[name].choices or ():
            holding = [status for params, status in launched if params.get(name) == value]
            if "ok" in holding or len(holding) >= ATTEMPTS:
                continue
            cand = {**incumbent, **space.params[name].requires, name: value, **fixed}
            cand = space.normalize(constraints.derive(cand, planner.recipe))
            if cand.get(name) != value or constraints.violations(cand, planner.recipe, rules):
                continue
            if key(cand) not in tried and not planner.verdict(cand).skip:
                options.append(cand)
    return max(options, key=planner.expected_throughput, default=None)


def launched(table: Iterable[TrialRow]) -> list[tuple[dict[str, Any], str]]:
    """Each launched trial's parameters and status (of the study's ``rows``), as :func:`open_value`
    reads them."""
    return [(r.params, r.status) for r in table if r.launched]


def unsettled(
    planner: Planner,
    study: optuna.Study,
    recipe: Recipe,
    space: Space,
    fixed: dict[str, Any],
    rules: Iterable[Callable[[dict[str, Any]], str | None]],
) -> bool:
    """Whether the walk still has such a value to run from the trial it steps from: no convergence
    stop may say "nothing untried beats the best" while it has."""
    best = walk_from(study, recipe)
    if best is None:
        return False
    ran = launched(rows(study))
    cand = open_value(planner, best.params, space, fixed, rules, tried(study), candidate_key, ran)
    return cand is not None
