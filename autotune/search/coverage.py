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

One number is known without a model: vLLM's share of the card (``gpu_memory_utilization``). vLLM's
own tuning guide cures preemption by raising it (more KV cache, more sequences in flight), so a larger
share is never slower; what it costs is memory. Where the speed prior does not read the share (a
trainer without TRL's vLLM switch: NeMo-RL, verl, OpenRLHF), one step that ran no faster had told the
walk the knob was flat, while the rollout's waves fall in steps (0/#2104 stopped converged at 0.71,
one share step from 0.96). Where the search would stop as converged, the walk raises it as far as
the measured peak leaves room for all of it (:func:`larger_share`), or one value at a time where no
peak is measured, and the stop waits for that: in the walk's own turns the steps crowded out others
and lost as many searches as they won.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import optuna

from autotune.candidate.space import Space
from autotune.recipe import Recipe
from autotune.search.knobs import fraction_knob
from autotune.search.planner import Planner
from autotune.search.state import tried, walk_from
from autotune.search.walk import Walk
from autotune.study import TrialRow, candidate_key, rows
from autotune.study.claims import launches
from autotune.study.ranking import headroom_limit

ATTEMPTS = 2  # launched trials of a value that did not run (OOM, crash) before it is settled unrun
CLOSING = ATTEMPTS + 1  # the last launches of --trials: room for a raise and the failures that settle it


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
    walk: Walk, incumbent: dict[str, Any], launched: Iterable[tuple[dict[str, Any], str]]
) -> dict[str, Any] | None:
    """The incumbent with one such knob set to a value not yet settled (``launched``: each launched
    trial's parameters and status), best expected first; None when every value is settled or every
    candidate that would run one is tried or ruled out."""
    planner, space, launched = walk.planner, walk.space, list(launched)
    options = []
    for name in unread(planner, space, walk.fixed, incumbent):
        for value in space.params[name].choices or ():
            holding = [status for params, status in launched if params.get(name) == value]
            if "ok" in holding or len(holding) >= ATTEMPTS:
                continue
            cand = walk.candidate({**incumbent, **space.params[name].requires, name: value, **walk.fixed})
            if cand.get(name) == value and walk.open(cand):
                options.append(cand)
    return max(options, key=planner.expected_throughput, default=None)


def larger_share(
    walk: Walk,
    incumbent: dict[str, Any],
    launched: list[tuple[dict[str, Any], str]],
    running: Iterable[str] = (),
) -> dict[str, Any] | None:
    """The incumbent with vLLM's share of the card raised, where the speed prior does not read the
    share (a trainer without TRL's ``use_vllm`` switch, whose generation the prior reads): to the
    largest value whose extra engine memory, all of it landing on the peak, stays inside the limit
    above the largest share measured at the incumbent's other knobs. Where no peak was measured there
    (a trainer that logs no memory, on a machine NVML cannot see) but a trial there ran, the smallest
    value a tenth of the range above the largest share that ran (a space's share without a step has
    64 points): nothing says how far the room goes, so each raise that runs is the next one's floor
    (0/#2008 of the NeMo-RL-style family stopped at 0.64 on the space's default 0.6, the best
    configurations all at 0.7 or more). None where nothing ran there, after :data:`ATTEMPTS`
    launched trials above it did not run, while such a raise is still
    running (``running``: the keys of running trials; under ``--parallel`` the next slot would step
    down past it), and on CPU (vLLM's CPU backend sizes its cache otherwise)."""
    planner, name = walk.planner, fraction_knob(incumbent)
    limit = headroom_limit(planner.recipe)
    if name is None or name in walk.fixed or name not in walk.space.params or not limit:
        return None
    if "use_vllm" in incumbent or planner.recipe.device == "cpu":
        return None  # TRL's and ms-swift's engine, whose share the prior reads; vLLM on CPU
    values = sorted((float(v) for v in walk.space.params[name].grid_values(64)), reverse=True)

    def alike(params: dict[str, Any]) -> bool:
        return all(params.get(k) == v for k, v in incumbent.items() if k != name)

    measured = [
        (float(s.params.get(name) or 0), s.peak_gib)
        for s in planner.seen
        if s.status == "ok" and s.peak_gib and alike(s.params)
    ]
    peak: float | None
    if measured:
        share, peak = max(measured)
    else:  # a trainer that logs no memory where NVML sees none: what ran is all that is known
        ran = [float(p.get(name) or 0) for p, status in launched if status == "ok" and alike(p)]
        if not ran:
            return None
        share, peak = max(ran), None
    above = [p for p, status in launched if status != "ok" and float(p.get(name) or 0) > share + 1e-9]
    if sum(alike(p) for p in above) >= ATTEMPTS:
        return None
    cap, running = planner.recipe.gpu_memory_gib, set(running)
    higher = [v for v in values if v > share + 1e-9]  # largest first
    if peak is None:  # no room is known: the next value up by a tenth of the range, a trial judges it
        tenth = (max(values) - min(values)) / 10
        higher = [v for v in higher if v >= share + tenth - 1e-9][-1:] or higher[:1]
    for value in higher:
        cand = walk.candidate({**incumbent, name: value, **walk.fixed})
        if walk.key(cand) in running:
            return None
        if (peak is None or peak + (value - share) * cap <= limit) and walk.open(cand):
            return cand
    return None


def closing(study: optuna.Study, trials: int) -> bool:
    """Whether the study's launches (every controller's, running claims included: under ``--parallel``
    the slots hold launches not yet told) leave only the last :data:`CLOSING` of ``trials``, where the walk
    raises vLLM's share as at a held stop. Most searches of a trainer whose knobs the speed prior does
    not read end at the limit, never held: on the NeMo-RL-style family, 62 of seed 0's 105 (their
    walk still stepping one knob at a time), and 0/#2098 ended there at 0.78 with the space's default
    share, 1.00 one raise up. A raise is the one step whose sign is known (a larger share is never
    slower), so the last launches go to it before the walk's next guess; where the share does not
    pay (a rollout already in one wave), they are the walk's steps lost."""
    return launches(study) >= trials - CLOSING


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
    walk, ran = Walk.of(planner, space, fixed, rules, tried(study), candidate_key), launched(rows(study))
    return open_value(walk, best.params, ran) is not None or larger_share(walk, best.params, ran) is not None
