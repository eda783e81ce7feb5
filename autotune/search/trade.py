"""Trade memory for a larger micro-batch: turn a memory saver on and spend what it frees.

The fastest GRPO configurations are often two knobs away from where a one-knob walk settles: the
micro-batch cannot go up (its next step OOMed or is ruled out), and turning checkpointing, offload or
ZeRO-3 on alone only costs speed, so neither single step is ever taken. People tuning by hand make
exactly that trade ("turn on checkpointing, then raise the batch"). From the incumbent, for each knob
whose next value needs less memory by what the planner knows (TRL's knobs, a space's declared ones,
directions measurements showed), the trade is that step together with the largest micro-batch that
nothing rules out and, where the calibrated model may judge, that it expects to keep the headroom.
Each incumbent gets each trade once (a tried candidate is not proposed again).
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
    needed while the micro-batch can still go up by itself)."""
    micro = micro_name(space)
    if micro is None or micro in fixed:
        return None
    rules = list(rules)
    choices = sorted(space.params[micro].choices or [])
    here = incumbent.get(micro)
    larger = [m for m in choices if here is not None and m > here]
    if not larger:
        return None
    limit = planner.recipe.gpu_memory_gib * (1 - planner.recipe.headroom)

    def fits(cand: dict[str, Any]) -> bool:
        if key(cand) in tried or constraints.violations(cand, planner.recipe, rules):
            return False
        if planner.verdict(cand).skip:
            return False
        return not (planner.use_model and planner.model_trusted and planner.predict(cand) > limit)

    step_up = space.normalize(constraints.derive({**incumbent, micro: larger[0]}, planner.recipe))
    if key(step_up) not in tried and fits(step_up):
        return None  # the plain step is open: the local walk takes it
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
                cand = space.normalize(constraints.derive({**saver, micro: m}, planner.recipe))
                if fits(cand):
                    trades.append(cand)
                    break
    return max(trades, key=planner.expected_throughput) if trades else None
