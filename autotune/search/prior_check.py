"""Whether the speed prior has been checked against what was measured.

The convergence stop ("no untried candidate is expected to beat the best") reads the prior: a prior
that is wrong about one knob (recomputation's cost, a trainer whose speed grows with its batch) makes
every candidate in that direction look hopeless, and the search stops at 80% of what was there. So the
stop trusts the prior only once its ranking of the measured trials agrees with the measurements:
of the pairs of successful trials whose measured throughputs differ by more than the noise, nearly
all must be ordered the same way by the prior. Without that, the stop waits until the promising
region has been measured: every neighbour of the incumbent (one or two knobs away) tried or ruled out,
or, for a prior that cannot be checked at all (a trainer it does not describe), every neighbour that
moves no knob measured to change nothing (:func:`local_optimum`).
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

from autotune.candidate.moves import neighbors
from autotune.candidate.space import Space
from autotune.search.headroom import incumbent
from autotune.search.planner import Planner
from autotune.search.walk import Walk

MIN_PAIRS = 3  # pairs told apart by measurement before the prior's ranking counts as checked
AGREEMENT = 0.8  # share of those pairs the prior must order as measured


def prior_agrees(planner: Planner, noise: float) -> bool:
    """Whether the prior orders the measured successful trials as the measurements do."""
    ok = [(planner.prior(s.params), s.throughput) for s in planner.seen if s.status == "ok" and s.throughput]
    agree = total = 0
    for (pa, ma), (pb, mb) in combinations(ok, 2):
        if max(ma, mb) <= min(ma, mb) * (1 + 2 * noise):
            continue  # within the noise: says nothing about the order
        total += 1
        agree += (pa - pb) * (ma - mb) > 0
    return total >= MIN_PAIRS and agree >= AGREEMENT * total


def neighbourhood_measured(walk: Walk) -> bool:
    """Whether every neighbour of the fastest measured trial that keeps the headroom is tried or
    ruled out."""
    planner = walk.planner
    best = incumbent(planner)
    if best is None:
        return False
    return all(
        walk.key(c) in walk.tried or planner.verdict(c).skip
        for c in neighbors(best.params, walk.space, walk.fixed, planner.recipe, walk.rules)
    )


def blind_knobs(planner: Planner, space: Space, fixed: dict[str, Any], params: dict[str, Any]) -> set[str]:
    """Searched knobs the prior does not read at ``params``: changing one leaves the prior as it is
    (a trainer's own knobs it does not know, say a PPO trainer's colocate_all_models)."""
    here = planner.prior(params)
    blind = set()
    for name, param in space.params.items():
        if name in fixed or param.choices is None:
            continue
        others = [v for v in param.choices if v != params.get(name)]
        if others and all(abs(planner.prior({**params, name: v}) - here) <= 1e-9 * here for v in others):
            blind.add(name)
    return blind


def local_optimum(
    walk: Walk, flat: set[str] | frozenset[str] = frozenset(), only: set[str] | None = None
) -> bool:
    """Whether the fastest measured trial is a local optimum by measurement: every neighbour (one or
    two knobs away: trading memory between two knobs is how the fastest configurations are reached)
    is tried or ruled out, except those moving a knob measured to change nothing (``flat``), and,
    given ``only``, those that move none of those knobs.

    This needs no prior, so it is the stop of a search whose prior cannot be checked (a trainer in
    its own knob names, whose speed the prior does not describe): after the patience, a measured
    local optimum is what a search without a trusted model can know. The best is the fastest that
    keeps the headroom free: one that ran inside it is no optimum to stop at."""
    planner = walk.planner
    best = incumbent(planner)
    if best is None:
        return False
    for cand in neighbors(best.params, walk.space, walk.fixed, planner.recipe, walk.rules):
        moved = {n for n in walk.space.params if cand.get(n) != best.params.get(n)}
        if moved & set(flat) or (only is not None and not moved & only):
            continue
        if walk.key(cand) not in walk.tried and not planner.verdict(cand).skip:
            return False
    return True
