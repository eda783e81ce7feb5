"""Keep moving along a knob while it pays; spend little on knobs measured to change nothing.

The local search takes the knobs in turn, one step each, which is slow on a trainer whose speed keeps
growing with one knob (the micro-batch, 1..32): half its trials go to knobs that do nothing. When the
incumbent beat a measured trial that differs from it in one knob only, the next step goes on along
that knob in the same direction, unless the memory measured on the way (the slope between the two
peaks) says the next value will not keep the headroom. A knob whose one-knob pairs of measurements all
differ by less than the noise is measured to have no effect: the local search passes it over.
A step along one knob that paid but peaked inside the headroom, from a success more than one value
away, is followed by the values between (:func:`between`): the fastest configuration that keeps the
headroom lies there, and neither end can be exported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from autotune.search.headroom import fits_headroom
from autotune.search.planner import Planner, Seen
from autotune.search.walk import Walk
from autotune.study.ranking import headroom_limit

FLAT = 0.05  # |log throughput ratio| under which a one-knob pair shows no effect
MIN_GAIN = 0.03  # the incumbent must beat the trial it moved from by this much to keep going
LEADERS = 5  # measured trials, fastest first, whose paying knob is followed when it promises a new best


def one_knob_pairs(ok: list[Seen], names: Iterable[str]) -> list[tuple[str, Seen, Seen]]:
    """(knob, a, b) for measured successes that differ in exactly that searched knob."""
    names = set(names)
    out = []
    for i, a in enumerate(ok):
        for b in ok[i + 1 :]:
            differ = [k for k in names if a.params.get(k) != b.params.get(k)]
            if len(differ) == 1:
                out.append((differ[0], a, b))
    return out


def flat_knobs(planner: Planner, names: Iterable[str], noise: float = 0.0) -> set[str]:
    """Knobs whose every measured one-knob pair (at least two) changed throughput by less than FLAT,
    or, where measurements are noisier, by less than twice the measured ``noise`` (two runs of one
    configuration differ that much)."""
    ok = [s for s in planner.seen if s.status == "ok" and s.throughput]
    effects: dict[str, list[float]] = {}
    for knob, a, b in one_knob_pairs(ok, names):
        effects.setdefault(knob, []).append(abs(math.log((a.throughput or 1) / (b.throughput or 1))))
    bar = max(FLAT, math.log1p(2 * noise))
    return {k for k, v in effects.items() if len(v) >= 2 and max(v) < bar}


def keep_going(walk: Walk, incumbent: Seen) -> dict[str, Any] | None:
    """The next value along the knob that made the incumbent, if it is untried, valid, not ruled
    out and, by the measured memory slope, expected to keep the headroom."""
    found = onward(walk, incumbent)
    return found[1] if found else None


def promising_onward(walk: Walk, best: float) -> dict[str, Any] | None:
    """The next step along a paying knob from a measured trial that is not the best, when going on
    at the gain it showed would beat the ``best`` throughput: a trial that gained 17% by doubling its
    batch with checkpointing on, 6% behind the best without it, is worth one more doubling."""
    ok = sorted(
        (s for s in walk.planner.seen if s.status == "ok" and s.throughput),
        key=lambda s: -(s.throughput or 0),
    )
    top: tuple[float, dict[str, Any]] | None = None
    for s in ok[:LEADERS]:
        found = onward(walk, s)
        if found is None:
            continue
        value = (s.throughput or 0) * (1 + found[0])
        if value > best * (1 + MIN_GAIN) and (top is None or value > top[0]):
            top = (value, found[1])
    return top[1] if top else None


def onward(walk: Walk, incumbent: Seen) -> tuple[float, dict[str, Any]] | None:
    """(gain, the next value) along the knob whose one-knob step made ``incumbent`` faster (see
    :func:`keep_going`), the largest gain first."""
    planner = walk.planner
    ok = [s for s in planner.seen if s.status == "ok" and s.throughput and s is not incumbent]
    limit = planner.recipe.gpu_memory_gib * (1 - planner.recipe.headroom)
    best: tuple[float, dict[str, Any]] | None = None
    for knob, a, b in one_knob_pairs([incumbent, *ok], walk.names):
        if a is not incumbent:
            continue
        gain = (incumbent.throughput or 0) / (b.throughput or 1) - 1
        param = walk.space.params[knob]
        if gain < MIN_GAIN or param.choices is None or len(param.choices) < 3:
            continue
        choices = list(param.choices)
        here, there = incumbent.params.get(knob), b.params.get(knob)
        if here not in choices or there not in choices:
            continue
        step = choices.index(here) - choices.index(there)
        nxt = choices.index(here) + (1 if step > 0 else -1)
        if not 0 <= nxt < len(choices):
            continue
        cand = walk.candidate({**incumbent.params, knob: choices[nxt]})
        if incumbent.peak_gib and b.peak_gib:  # the memory slope measured on the way
            span = abs(step)
            if incumbent.peak_gib + (incumbent.peak_gib - b.peak_gib) / span > limit:
                continue
        if not walk.open(cand):
            continue
        if best is None or gain > best[0]:
            best = (gain, cand)
    return best


def _line(param: Any) -> list[Any]:
    """Every value of a knob, in order: its choices, or its own step's grid (``Param.grid_values``
    lists a knob of few steps whole and takes evenly spaced points of a longer one)."""
    if param.choices is not None:
        return list(param.choices)
    return param.grid_values(64)


def _place(line: list[Any], value: Any) -> int | None:
    """Where ``value`` sits on a knob's line (floats within rounding), or None."""
    for i, v in enumerate(line):
        if v == value or (
            isinstance(v, float)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and abs(v - value) < 1e-9
        ):
            return i
    return None


def between(walk: Walk, best: float) -> dict[str, Any] | None:
    """The value halfway between two successes one knob apart, more than one value apart, of which
    the faster peaked inside the headroom (it cannot be exported) and the slower kept it: a step that
    paid overshot the headroom. Taken when the overshoot beat the ``best`` exportable throughput;
    the most promising first. Seen in a PPO search: the vLLM fraction 0.3 -> 0.5 gained 19% but
    peaked at 77.7 of 75.3 GiB, and 0.4, the best configuration of the landscape, was never run."""
    limit = headroom_limit(walk.planner.recipe)
    ok = [s for s in walk.planner.seen if s.status == "ok" and s.throughput and not s.leftover]
    top: tuple[float, dict[str, Any]] | None = None
    for knob, a, b in one_knob_pairs(ok, walk.names):
        if fits_headroom(b.peak_gib, limit):
            a, b = b, a  # a keeps the headroom, b (faster) peaked inside it
        if not fits_headroom(a.peak_gib, limit) or fits_headroom(b.peak_gib, limit):
            continue
        line = _line(walk.space.params[knob])
        i, j = _place(line, a.params.get(knob)), _place(line, b.params.get(knob))
        # the overshoot's own throughput bounds what lies between (a knob's gain saturates, so the
        # values between may hold most of it: PPO's fraction at 0.4 ran at 0.99 of 0.5's)
        value = b.throughput or 0.0
        if i is None or j is None or abs(i - j) < 2 or value <= best * (1 + MIN_GAIN):
            continue
        cand = walk.candidate({**a.params, knob: line[(i + j) // 2]})
        if walk.open(cand) and (top is None or value > top[0]):
            top = (value, cand)
    return top[1] if top else None
