"""Trade memory for a larger micro-batch: turn a memory saver on and spend what it frees.

The fastest GRPO configurations are often two knobs away from where a one-knob walk settles: the
micro-batch cannot go up (its next step OOMed or is ruled out), and turning checkpointing, offload or
ZeRO-3 on alone only costs speed, so neither single step is ever taken. People tuning by hand make
exactly that trade ("turn on checkpointing, then raise the batch"). From the incumbent, for each knob
whose next value needs less memory by what the planner knows (TRL's knobs, a space's declared ones,
directions measurements showed), the trade is that step together with the largest micro-batch that
nothing rules out and, where the calibrated model may judge, that it expects to keep the headroom.
Each incumbent gets each trade once: one that ran out of memory is tried again one micro-batch
smaller, one that ran is not (on the benchmark that rule took the share at 0.95 from 73% to 76%).
The trade backwards (a saver off, paid for with a smaller micro-batch) was measured too and lost
(67%): see docs/benchmarks-notes.md.

A knob whose effect on memory nobody knows can be a saver too, and where the trainer logs no memory
no pair of peaks ever shows it. :func:`saver_experiment` asks it directly: the micro-batch's next
step ran out of memory, and a knob measured to cost speed (as every saver does: it recomputes,
moves or shards to save memory) is moved alone from that OOM. If the copy runs, the pair hints at the
knob's direction (``knobs.learn``): the export's risk test reads the hint at once, the trade and the
walk once a pair at a second setting of the other knobs agrees (until then the knob counts as
unknown here, so a second stuck OOM may ask it again).
"""

from __future__ import annotations

from typing import Any

from autotune.candidate.space import Space
from autotune.candidate.vector import at_least
from autotune.search.planner import Planner
from autotune.search.walk import Walk


def micro_name(space: Space) -> str | None:
    """The space's micro-batch knob, if it has one with a list of choices."""
    batch = space.batch
    name = batch.micro_batch if batch is not None else None
    if name is None or name not in space.params or space.params[name].choices is None:
        return None
    return name


def larger_sizes(space: Space, incumbent: dict[str, Any], fixed: dict[str, Any]) -> tuple[str | None, list]:
    """The space's micro-batch knob and its values above the incumbent's, or (None, []) where the
    micro-batch is not the search's to move."""
    micro = micro_name(space)
    here = incumbent.get(micro) if micro is not None else None
    if micro is None or micro in fixed or here is None:
        return None, []
    return micro, [m for m in sorted(space.params[micro].choices or []) if m > here]


def next_trade(walk: Walk, incumbent: dict[str, Any]) -> dict[str, Any] | None:
    """The untried trade from ``incumbent`` with the best expected throughput, or None (no trade is
    needed while the micro-batch can still go up by itself). A trade that ran is not followed by the
    same trade one micro-batch smaller; only one that ran out of memory is."""
    planner, space, fixed = walk.planner, walk.space, walk.fixed
    micro, larger = larger_sizes(space, incumbent, fixed)
    if micro is None:
        return None

    def with_micro(params: dict[str, Any], m: Any) -> dict[str, Any]:
        return walk.candidate({**params, micro: m})

    def fits(cand: dict[str, Any]) -> bool:
        return walk.open(cand) and planner.expected_to_fit(cand)

    if not larger or fits(with_micro(incumbent, larger[0])):
        return None  # the plain step up is open: the local walk takes it
    ran = {walk.key(s.params) for s in planner.seen if s.status == "ok"}
    base = planner.vector(incumbent)
    trades = []
    for name, param in space.params.items():
        if name in fixed or name == micro or param.choices is None or not space.relevant(name, incumbent):
            continue
        values = list(param.choices)
        if incumbent.get(name) not in values:
            continue
        i = values.index(incumbent.get(name))
        for j in (i - 1, i + 1):
            if not 0 <= j < len(values):
                continue
            saver = {**incumbent, name: values[j]}
            if not planner.knobs.same_unknown(saver, incumbent):
                continue  # a knob whose effect on memory is unknown: no saver by what is known
            lean = planner.vector(saver)
            if lean == base or not at_least(base, lean):
                continue  # needs no less memory in every known knob
            for m in reversed(larger):  # the largest micro-batch it may afford
                cand = with_micro(saver, m)
                if walk.key(cand) in ran:
                    break  # this trade was measured
                if fits(cand):
                    trades.append(cand)
                    break
    return max(trades, key=planner.expected_throughput) if trades else None


def saver_experiment(walk: Walk, incumbent: dict[str, Any], spread: float) -> dict[str, Any] | None:
    """An OOM at the incumbent's next micro-batch with one knob of unknown effect moved to a value
    measured to cost speed (:func:`costly_values`), or None. Seen: a trainer logging no memory,
    micro-batch 8 out of memory twice without activation offload, which halves the activations'
    memory; offload was measured 24% slower at micro-batch 4 and never tried at 8, and micro-batch 4
    was exported (0.81 of the best possible)."""
    planner, fixed = walk.planner, walk.fixed
    micro, larger = larger_sizes(walk.space, incumbent, fixed)
    if micro is None or not larger:
        return None
    known = planner.knobs
    step = planner.vector(walk.candidate({**incumbent, micro: larger[0]}))
    slower = [(n, v) for n, v in costly_values(planner, spread) if n in walk.space.params]
    stuck = [
        o
        for o in planner.seen
        if o.status == "oom"
        and o.oom_kind == "cuda"
        and not o.leftover
        and o.params.get(micro) == larger[0]
        and at_least(step, planner.vector(o.params))
        # not from an experiment's own OOM (a costly value of a knob of unknown effect that the
        # incumbent does not hold): it would start a second experiment from the first, then a
        # third (every subset of them). Known knobs (ZeRO-3, fewer generations) may cost speed too
        # and are the walk's, not experiments: an OOM holding them is a start like any other.
        and not any(
            o.params.get(n) == v and incumbent.get(n) != v and known.direction(n, o.params) is None
            for n, v in slower
        )
    ]
    out = []
    for o in stuck:
        for name, value in slower:
            if name in fixed or known.direction(name, o.params) is not None or o.params.get(name) == value:
                continue
            cand = walk.candidate({**o.params, name: value})
            if walk.open(cand):
                out.append(cand)
    return max(out, key=planner.expected_throughput) if out else None


def costly_values(planner: Planner, spread: float) -> list[tuple[str, Any]]:
    """(knob, value) pairs measured slower than the knob's other values, all else equal: what a
    memory saver looks like from its speed alone. Slower in every one-knob pair of successes the
    value takes part in, and in at least one by more than twice the noise ``spread``: one pair at
    8-10% noise makes a knob that does nothing look costly about half the time (before any
    confirmation has measured the noise, ``spread`` is only the 3% assumed)."""
    ok = [s for s in planner.seen if s.status == "ok" and s.throughput]
    ratios: dict[tuple[str, Any], list[float]] = {}
    for i, a in enumerate(ok):
        for b in ok[i + 1 :]:
            differ = [n for n in set(a.params) | set(b.params) if a.params.get(n) != b.params.get(n)]
            if len(differ) != 1:
                continue
            name = differ[0]
            for x, y in ((a, b), (b, a)):
                ratio = (x.throughput or 0) / (y.throughput or 1)
                ratios.setdefault((name, x.params.get(name)), []).append(ratio)
    out = [nv for nv, rs in ratios.items() if max(rs) < 1 and min(rs) * (1 + 2 * spread) < 1]
    return sorted(out, key=repr)
