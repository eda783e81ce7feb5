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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.candidate.vector import at_least
from autotune.search.planner import Planner

Rules = Iterable[Callable[[dict[str, Any]], "str | None"]]


def micro_name(space: Space) -> str | None:
    """The space's micro-batch knob, if it has one with a list of choices."""
    batch = space.batch
    name = batch.micro_batch if batch is not None else None
    if name is None or name not in space.params or space.params[name].choices is None:
        return None
    return name


def next_trade(
    planner: Planner,
    incumbent: dict[str, Any],
    space: Space,
    fixed: dict[str, Any],
    rules: Rules,
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
) -> dict[str, Any] | None:
    """The untried trade from ``incumbent`` with the best expected throughput, or None (no trade is
    needed while the micro-batch can still go up by itself). A trade that ran is not followed by the
    same trade one micro-batch smaller; only one that ran out of memory is."""
    micro = micro_name(space)
    here = incumbent.get(micro) if micro is not None else None
    if micro is None or micro in fixed or here is None:
        return None
    rules = list(rules)
    larger = [m for m in sorted(space.params[micro].choices or []) if m > here]

    def with_micro(params: dict[str, Any], m: Any) -> dict[str, Any]:
        return space.normalize(constraints.derive({**params, micro: m}, planner.recipe))

    def fits(cand: dict[str, Any]) -> bool:
        if key(cand) in tried or constraints.violations(cand, planner.recipe, rules):
            return False
        if planner.verdict(cand).skip:
            return False
        return planner.expected_to_fit(cand)

    if not larger or fits(with_micro(incumbent, larger[0])):
        return None  # the plain step up is open: the local walk takes it
    ran = {key(s.params) for s in planner.seen if s.status == "ok"}
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
                if key(cand) in ran:
                    break  # this trade was measured
                if fits(cand):
                    trades.append(cand)
                    break
    return max(trades, key=planner.expected_throughput) if trades else None
