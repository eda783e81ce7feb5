"""The untried candidates nothing rules out: where stalled proposals go, and when the space is spent.

TPE, random valid proposals and the local walk can all keep proposing what is invalid, already
measured or skipped (a tight card after a few vLLM failures: hundreds of such proposals in a row)
while candidates that no measured failure dominates sit untouched in the grid. Exhaustion is
therefore decided over the grid itself (the planner's pool: every valid candidate of the space), and
a stalled proposer is handed the best expected of the open ones instead of being asked again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import compress
from typing import Any

from autotune.candidate.memory import Estimate
from autotune.search.planner import Planner

LOOK_AHEAD = 24  # open candidates (in prior order) among which the best expected one is chosen

Pool = list[tuple[float, dict[str, Any]]]


def open_candidates(
    planner: Planner,
    pool: Iterable[tuple[float, dict[str, Any]]],
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
) -> Iterator[dict[str, Any]]:
    """Untried candidates of the pool that no measured failure and no calibrated prediction rules
    out, in the order of the speed prior (lazily: the verdict is the costly part)."""
    for _prior, cand in pool:
        if key(cand) in tried:
            continue
        if not planner.verdict(cand).skip:
            yield cand


def next_open(
    planner: Planner, pool: Pool, tried: set[str], key: Callable[[dict[str, Any]], str]
) -> dict[str, Any] | None:
    """The open candidate to run next: of the first :data:`LOOK_AHEAD` groups by prior that the model
    finds plausible (:meth:`Planner.plausible`: the prior ranks the largest configurations first,
    which on a tight card the model knows do not fit, trusted to veto or not), or of the first groups
    by prior when none open is, the one with the best expected throughput (the prior corrected by
    what was measured nearby). A group is the candidates that differ only in knobs whose effect on
    memory is unknown: the prior cannot tell them apart, so a look-ahead of them alone would see one
    configuration. None when nothing is left open."""
    plausible = compress(pool, planner.plausible_in(pool))
    ahead = look_ahead(planner, plausible, tried, key) or look_ahead(planner, pool, tried, key)
    return max(ahead, key=planner.expected_throughput) if ahead else None


def look_ahead(
    planner: Planner,
    pool: Iterable[tuple[float, dict[str, Any]]],
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """The open candidates of the first :data:`LOOK_AHEAD` groups of ``pool`` (alike but for knobs
    of unknown effect on memory: one group)."""
    ahead: list[dict[str, Any]] = []
    groups: set[tuple] = set()
    for cand in open_candidates(planner, pool, tried, key):
        known = tuple(sorted((k, repr(v)) for k, v in cand.items() if planner.knobs.direction(k, cand)))
        if known not in groups and len(groups) >= LOOK_AHEAD:
            break
        groups.add(known)
        ahead.append(cand)
    return ahead


def exhausted(planner: Planner, pool: Pool, tried: set[str], key: Callable[[dict[str, Any]], str]) -> bool:
    """Whether no untried candidate is left that nothing rules out. Asked after every trial: the
    open candidate found last time is checked first, since one that is still open answers it
    without walking the grid again (the walk took a sixth of a simulated search's time)."""
    held = planner.open_hint
    hint = held[1] if held is not None and held[0] is pool else None
    if hint is not None and key(hint) not in tried and not planner.verdict(hint).skip:
        return False
    found = next(open_candidates(planner, pool, tried, key), None)
    planner.open_hint = (pool, found)
    return found is None


def leanest(planner: Planner, pool: Pool) -> tuple[dict[str, Any], Estimate] | None:
    """The candidate the (uncalibrated) model predicts smallest, with its estimate."""
    if not pool:
        return None
    sizes = planner.sizes(pool)
    i = min(range(len(pool)), key=lambda j: sizes[j][0])
    return pool[i][1], planner.raw(pool[i][1])
