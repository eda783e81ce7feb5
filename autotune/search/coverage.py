"""Every value of a switch or category nothing describes is measured once before the search settles.

The walk's rankings read two things: the memory model (or a declared direction) and the speed prior.
A switch or category that neither reads (NeMo-RL's ``recompute_granularity``: full or selective; a
PPO trainer's ``colocate_all_models``) ties with the incumbent in every ranking, so whether its other
value pays is left to the turn the rotation of knobs happens to give it, after momentum, trades and
co-leaders have had theirs. On the NeMo-RL-style family the selective recomputation the best
configurations share was never run at all in 39 of seed 0's 86 searches below 0.95 of the best
(docs/benchmarks-notes.md, forty-seventh pass). What nothing predicts must be measured: each such
value is run once, from the incumbent (what the value requires set with it), and a search does not
stop as converged while one of them is still open. Integer knobs are left to the walk's steps, which
move them up and down by one value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.search.planner import Planner
from autotune.search.prior_check import blind_knobs


def unread(planner: Planner, space: Space, fixed: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """The searched switches and categories at ``params`` that neither the memory side (the model, a
    declared or a learned direction) nor the speed prior reads, in the space's order."""
    blind = blind_knobs(planner, space, fixed, params)
    return [
        name
        for name, param in space.params.items()
        if name in blind
        and param.type in ("bool", "categorical")
        and planner.knobs.direction(name, {**params, name: param.default}) is None
    ]


def open_value(
    planner: Planner,
    incumbent: dict[str, Any],
    space: Space,
    fixed: dict[str, Any],
    rules: Iterable[Callable[[dict[str, Any]], str | None]],
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
) -> dict[str, Any] | None:
    """The incumbent with one such knob set to a value no measured success holds, best expected first;
    None when every value has run (or every candidate that would run it is tried or ruled out)."""
    rules = list(rules)
    ran = [s.params for s in planner.seen if s.status == "ok"]
    options = []
    for name in unread(planner, space, fixed, incumbent):
        for value in space.params[name].choices or ():
            if any(p.get(name) == value for p in ran):
                continue
            cand = {**incumbent, **space.params[name].requires, name: value}
            cand = space.normalize(constraints.derive(cand, planner.recipe))
            if cand.get(name) != value or constraints.violations(cand, planner.recipe, rules):
                continue
            if key(cand) not in tried and not planner.verdict(cand).skip:
                options.append(cand)
    return max(options, key=planner.expected_throughput, default=None)
