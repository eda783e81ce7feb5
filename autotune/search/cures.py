"""The walk toward feasibility: from every out-of-memory, along what cures that kind of failure.

While nothing has fit, the search steps from its OOMs toward less memory. Each kind of failure has
its own cure, and stepping the wrong way makes it worse: vLLM's KV cache finding too little room is
cured by a larger fraction (or sleep mode, or more tensor parallelism), whereas vLLM failing to start
beside the trainer's states is cured by a smaller fraction or less trainer state (ZeRO-3, parameter
offload), and a CUDA OOM in the trainer by a smaller batch, checkpointing or offload. The candidates
are the untried neighbours of every OOM that move at least one knob its cure's way; the fastest one
the model expects to fit is next, else the one it predicts smallest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from autotune.candidate.moves import neighbors
from autotune.candidate.space import Space
from autotune.candidate.vector import OFFLOAD_RANK
from autotune.search.planner import Planner, Seen

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


# knobs known to move memory (TRL's and ms-swift's): a step toward a cure changes no other of them
MEMORY = frozenset({name for rule in CURES.values() for name in rule} | {"use_vllm", "vllm_mode"})


def _value(name: str, value: Any) -> float:
    if name == "offload":
        return float(-OFFLOAD_RANK.get(value, 2))  # more offload = larger
    return float(value or 0)


def cures(seen: Seen, cand: dict[str, Any], planner: Planner, batch_name: str | None) -> bool:
    """Whether ``cand`` moves at least one knob the way that cures ``seen``'s kind of failure (for
    a CUDA OOM also a smaller micro-batch in the space's own name, or a knob the space declares to
    need less memory that way) and no other knob known to move memory; knobs whose effect is
    unknown may change along."""
    rule = dict(CURES.get(seen.oom_kind or "cuda", {}))
    if (seen.oom_kind or "cuda") == "cuda":
        if batch_name:
            rule[batch_name] = -1
        for name, way in planner.knobs.declared.items():
            if way in ("up", "down"):
                rule[name] = -1 if way == "up" else +1
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


def toward_feasible(
    planner: Planner,
    space: Space,
    fixed: dict[str, Any],
    rules: Iterable[Callable[[dict[str, Any]], str | None]],
    tried: set[str],
    key: Callable[[dict[str, Any]], str],
) -> dict[str, Any] | None:
    """While nothing has fit yet: the next step from the OOMs along their cures (see the module)."""
    if not planner.use_model or any(s.status == "ok" for s in planner.seen):
        return None
    ooms = [s for s in planner.seen if s.status == "oom" and not s.leftover]
    rules = list(rules)
    batch_name = space.batch.micro_batch if space.batch is not None else None
    options: dict[str, dict[str, Any]] = {}
    for s in ooms:
        for c in neighbors(s.params, space, fixed, planner.recipe, rules):
            k = key(c)
            if k not in tried and k not in options and cures(s, c, planner, batch_name):
                options[k] = c
    fine = [c for c in options.values() if not planner.verdict(c).skip]
    if not fine:
        return None
    limit = planner.recipe.gpu_memory_gib * (1 - planner.recipe.headroom)
    fitting = [c for c in fine if planner.predict(c) <= limit]
    if fitting:
        return max(fitting, key=planner.expected_throughput)
    return min(fine, key=planner.predict)
