"""The walk toward feasibility: from every out-of-memory, along what cures that kind of failure.

While nothing has fit, the search steps from its OOMs toward less memory. Each kind of failure has
its own cure, and stepping the wrong way makes it worse: vLLM's KV cache finding too little room is
cured by a larger fraction (or sleep mode, or more tensor parallelism), whereas vLLM failing to start
beside the trainer's states is cured by a smaller fraction or less trainer state (ZeRO-3, parameter
offload), and a CUDA OOM in the trainer by a smaller batch, checkpointing or offload. The candidates
are the untried neighbours of every OOM that move at least one knob its cure's way; the fastest one
the model expects to fit is next, else the one it predicts smallest.

After :data:`LEAN_AFTER` CUDA OOMs with nothing fit, the walk has not found the edge, and one knob at a
time may never reach it: on the held-out verl-style 3B on 4 x 24 GB every step of thirty died, where
what fits needed several memory knobs moved at once, and the engine's undeclared tensor parallelism
tripled every OOM's neighbours (docs/benchmarks-notes.md, thirty-eighth pass). Then the next step is
the leanest open candidate by every knob of known direction, what a person does on a card where
nothing runs: find what fits, then climb from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.moves import neighbors
from autotune.candidate.vector import OFFLOAD_RANK, memory_vector
from autotune.search.knobs import VLLM_FRACTION, KnobMemory, fraction_knob, order_of
from autotune.search.planner import Planner, Seen
from autotune.search.walk import Walk

# knob -> +1 when a larger value cures, -1 when a smaller one does, per failure kind (TRL's names)
CURES: dict[str, dict[str, int]] = {
    "vllm_kv": {
        "vllm_gpu_memory_utilization": +1,
        "vllm_enable_sleep_mode": +1,
        "vllm_tensor_parallel_size": +1,
    },
    "vllm_startup": {"vllm_gpu_memory_utilization": -1, "zero_stage": +1, "offload": +1, "sleep_level": +1},
    "cuda": {
        "per_device_train_batch_size": -1,
        "gradient_checkpointing": +1,
        "offload": +1,
        "zero_stage": +1,
        "offload_optimizer": +1,
        "offload_model": +1,
    },
    "host": {"offload": -1},
}


# CUDA OOMs with nothing fit yet after which the walk goes to the leanest open candidate instead of
# one more step along a cure
LEAN_AFTER = 3

# knobs known to move memory (TRL's and ms-swift's): a step toward a cure changes no other of them
MEMORY = frozenset({name for rule in CURES.values() for name in rule} | {"use_vllm", "vllm_mode"})


def _value(name: str, value: Any) -> float:
    if name == "offload":
        return float(-OFFLOAD_RANK.get(value, 2))  # more offload = larger
    return float(value or 0)


def cures(seen: Seen, cand: dict[str, Any], planner: Planner, batch_name: str | None) -> bool:
    """Whether ``cand`` moves at least one knob the way that cures ``seen``'s kind of failure (for
    a CUDA OOM also a smaller micro-batch in the space's own name, or a knob the space declares to
    need less memory that way; for vLLM's start-up beside the trainer also a knob declared to save
    memory; vLLM's share under whatever name the trainer gives it, :func:`knobs.fraction_knob`) and
    no other knob known to move memory; knobs whose effect is unknown may change along."""
    kind = seen.oom_kind or "cuda"
    rule = dict(CURES.get(kind, {}))
    fraction = fraction_knob(seen.params)
    if fraction is not None and VLLM_FRACTION in rule:  # vLLM's share, in the trainer's own name
        rule[fraction] = rule.pop(VLLM_FRACTION)
    if kind == "cuda":
        if batch_name:
            rule[batch_name] = -1
        for name, way in planner.knobs.declared.items():
            if way in ("up", "down"):
                rule[name] = -1 if way == "up" else +1
    elif kind == "vllm_startup":  # less trainer state at start: every knob declared to save memory
        for name, way in planner.knobs.declared.items():
            if way == "down":
                rule.setdefault(name, +1)
    cured = False
    for name in set(cand) | set(seen.params):
        if cand.get(name) == seen.params.get(name):
            continue
        if name in rule:
            change = _value(name, cand.get(name)) - _value(name, seen.params.get(name))
            if change * rule[name] <= 0:
                return False  # the wrong way for this failure
            cured = True
        elif name in MEMORY or name == batch_name or planner.knobs.declared.get(name) in ("up", "down"):
            return False  # a knob that moves memory but does not cure this failure
    return cured


def lean_order(planner: Planner, pool: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, int]]:
    """(score, index) of each candidate of ``pool``, leanest first, computed once per pool: the sum
    over every knob of known direction (TRL's memory vector but vLLM's fraction, and the knobs the
    space declares or that are known by name) of the candidate's rank among the pool's values of
    it, from 0 to 1 (a knob a candidate does not have counts 0); fastest by prior among equals.
    vLLM's fraction is left out: a smaller one saves memory but starves the KV cache, so the lean
    step keeps the last OOM's."""
    if planner.lean is not None and planner.lean[0] is pool:
        return planner.lean[1]
    # directions declared or known by name (ms-swift's offloads), not learned: the order is kept
    # for the search, and while nothing fits no measured pair has taught one
    known = replace(planner.knobs, learned={}, hinted={})
    named = [_lean_components(planner, known, cand) for _, cand in pool]
    values: dict[str, set[float]] = {}
    for comps in named:
        for name, x in comps.items():
            values.setdefault(name, set()).add(x)
    ranks = {n: {x: i / max(len(v) - 1, 1) for i, x in enumerate(sorted(v))} for n, v in values.items()}
    scores = [round(sum(ranks[n][x] for n, x in comps.items()), 9) for comps in named]
    order = sorted(range(len(pool)), key=lambda i: (scores[i], -pool[i][0]))
    planner.lean = (pool, [(scores[i], i) for i in order])
    return planner.lean[1]


def _lean_components(planner: Planner, knobs: KnobMemory, cand: dict[str, Any]) -> dict[str, float]:
    trl = constraints.as_trl(cand, planner.recipe)
    comps = memory_vector(trl, planner.recipe.dp_gpus(trl))._asdict()
    comps.pop("vllm_fraction")
    for name in cand:
        way = knobs.direction(name, cand)
        if way in ("up", "down") and name != fraction_knob(cand) and knobs.ordered(name, cand[name]):
            x = order_of(knobs, name, cand[name])
            comps[f"knob:{name}"] = x if way == "up" else -x
    return comps


def leanest_open(
    planner: Planner,
    pool: list[tuple[float, dict[str, Any]]],
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
    like: dict[str, Any],
) -> dict[str, Any] | None:
    """The untried candidate nothing rules out that needs least memory by every knob of known
    direction (:func:`lean_order`); among the equally lean, the one nearest ``like`` (the last OOM)
    in the knobs of unknown effect and vLLM's fraction, then the fastest by prior."""
    _, unknown = planner.knobs.split(like)
    fraction = float(like.get(fraction_knob(like) or "") or 0)
    group: list[dict[str, Any]] = []
    level = None
    for score, i in lean_order(planner, pool):
        if group and score != level:
            break  # the leanest score with an open candidate: choose among its open ones
        cand = pool[i][1]
        if key(cand) not in tried and not planner.verdict(cand).skip:
            group.append(cand)
            level = score
    if not group:
        return None
    return min(
        group,
        key=lambda c: (
            len(set(planner.knobs.split(c)[1]) - set(unknown)),
            abs(float(c.get(fraction_knob(c) or "") or 0) - fraction),
        ),
    )


def toward_feasible(walk: Walk) -> dict[str, Any] | None:
    """While nothing has fit yet: the next step from the OOMs along their cures (see the module)."""
    planner, space, key = walk.planner, walk.space, walk.key
    if not planner.use_model or any(s.status == "ok" for s in planner.seen):
        return None
    ooms = [s for s in planner.seen if s.status == "oom" and not s.leftover]
    batch_name = space.batch.micro_batch if space.batch is not None else None
    options: dict[str, dict[str, Any]] = {}
    for s in ooms:
        for c in neighbors(s.params, space, walk.fixed, planner.recipe, walk.rules):
            k = key(c)
            if k not in walk.tried and k not in options and cures(s, c, planner, batch_name):
                options[k] = c
    limit = planner.recipe.gpu_memory_gib * (1 - planner.recipe.headroom)
    cuda = [s for s in ooms if (s.oom_kind or "cuda") == "cuda"]
    if len(cuda) >= LEAN_AFTER:  # the walk has not found the edge: find what fits first
        pool = planner.pool(space, walk.fixed, walk.rules)
        lean = leanest_open(planner, pool, walk.tried, key, cuda[-1].params)
        if lean is not None:
            return lean
    fine = [c for c in options.values() if not planner.verdict(c).skip]
    if not fine:
        return None
    fitting = [c for c in fine if planner.predict(c) <= limit]
    if fitting:
        return max(fitting, key=planner.expected_throughput)
    return min(fine, key=planner.predict)
