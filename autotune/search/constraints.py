"""Rules a candidate must obey before anything is launched.

These are TRL's own validation rules (GRPOConfig.__post_init__), DeepSpeed's offload rules and
vLLM's tensor-parallel rule, checked in-process in microseconds. A candidate that breaks one is
recorded as invalid and told to Optuna as infeasible, so it costs no GPU time and teaches the
sampler to stay away. Runners may add rules of their own (e.g. a package that is not installed).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable

from autotune.errors import UsageError
from autotune.recipe import Recipe
from autotune.search.space import Space

# Parameters the rules look at; exhaustive checks enumerate only these.
RULE_PARAMS = [
    "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "zero_stage",
    "offload", "use_vllm", "vllm_mode", "vllm_tensor_parallel_size", "steps_per_generation",
    "generation_batch_size",
]


def derive(params: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """Fill derived values: accumulation from ``--global-batch`` when one is given.

    Returns a new dict; when the global batch does not divide, accumulation is left as 0 so that
    ``violations`` reports it.
    """
    out = dict(params)
    if recipe.global_batch:
        per_step = int(out["per_device_train_batch_size"]) * max(recipe.dp_gpus(out), 1)
        out["gradient_accumulation_steps"] = (
            recipe.global_batch // per_step if recipe.global_batch % per_step == 0 else 0)
    return out


def violations(params: dict[str, Any], recipe: Recipe,
               extra_rules: Iterable[Callable[[dict[str, Any]], str | None]] = ()) -> list[str]:
    """Every broken rule as a short sentence; empty when the candidate may be launched."""
    out: list[str] = []
    pdbs = int(params.get("per_device_train_batch_size", 8))
    gas = int(params.get("gradient_accumulation_steps", 1))
    gens = int(params.get("num_generations", 8))
    dp = recipe.dp_gpus(params)
    use_vllm = bool(params.get("use_vllm", False))
    mode = params.get("vllm_mode", "colocate")
    tp = int(params.get("vllm_tensor_parallel_size", 1))
    stage = int(params.get("zero_stage", 0))
    offload = params.get("offload", "none")

    if dp < 1:
        out.append(f"vLLM server mode with tensor parallel {tp} leaves no GPU of {recipe.gpus} to train on")
        return out
    if recipe.global_batch and gas == 0:
        out.append(f"global batch {recipe.global_batch} is not divisible by per-device batch {pdbs} "
                   f"x {dp} data-parallel GPUs")
        return out
    if gens < 2:
        out.append("num_generations must be at least 2 (GRPO needs 2 completions per prompt)")
    generation_batch, how = generation_batch_of(params, dp)
    if generation_batch is None:
        out.append(how)
    elif gens >= 2 and generation_batch % gens:
        out.append(f"generation batch {generation_batch} (= {how}) is not divisible by num_generations {gens}")
    if offload not in ("none", "optimizer", "optimizer+params"):
        out.append(f"offload '{offload}' is not none, optimizer or optimizer+params")
    if offload == "optimizer" and stage < 2:
        out.append(f"optimizer offload needs ZeRO stage 2 or 3, not {stage}")
    if offload == "optimizer+params" and stage != 3:
        out.append(f"parameter offload needs ZeRO stage 3, not {stage}")
    if use_vllm:
        if mode == "server":
            if tp >= recipe.gpus:
                out.append(f"vLLM server mode needs GPUs left to train: tensor parallel {tp} of {recipe.gpus}")
        elif tp > recipe.gpus or recipe.gpus % tp:
            out.append(f"vLLM tensor parallel size {tp} must divide the {recipe.gpus} GPU(s)")
        util = params.get("vllm_gpu_memory_utilization")
        if mode == "colocate" and util is not None and not 0.0 < float(util) < 1.0:
            out.append(f"vllm_gpu_memory_utilization {util} must be between 0 and 1")
    for rule in extra_rules:
        message = rule(params)
        if message:
            out.append(message)
    return out


def generation_batch_of(params: dict[str, Any], dp: int) -> tuple[int | None, str]:
    """Completions generated per generation round, as TRL's GRPOConfig derives it, and how.

    A space may set ``steps_per_generation`` or ``generation_batch_size`` (not both); without either
    TRL generates once per optimizer step (steps_per_generation = accumulation). Returns (None,
    the reason) for what GRPOConfig itself refuses.
    """
    pdbs = int(params.get("per_device_train_batch_size", 8))
    spg, gbs = params.get("steps_per_generation"), params.get("generation_batch_size")
    if spg is not None and gbs is not None:
        return None, "generation_batch_size and steps_per_generation cannot both be set (TRL refuses it)"
    if gbs is not None:
        if int(gbs) % (pdbs * dp):
            return None, (f"generation_batch_size {gbs} is not divisible by the global micro-batch "
                          f"{pdbs * dp} (= {pdbs} per device x {dp} GPUs)")
        return int(gbs), f"generation_batch_size {gbs}"
    steps = int(params.get("gradient_accumulation_steps", 1)) if spg is None else int(spg)
    what = "accumulation" if spg is None else "steps_per_generation"
    return pdbs * dp * steps, f"{pdbs} per device x {dp} GPUs x {steps} {what}"


def valid_combinations(space: Space, recipe: Recipe, fixed: dict[str, Any],
                       extra_rules: Iterable[Callable[[dict[str, Any]], str | None]] = ()
                       ) -> tuple[list[dict[str, Any]], Counter[str]]:
    """Every valid combination of the parameters the rules look at (the rest at defaults), and
    how often each rule blocked one. Stays in the tens of thousands even for wide spaces."""
    extra_rules = list(extra_rules)
    blocking: Counter[str] = Counter()
    valid: list[dict[str, Any]] = []
    names = [n for n in RULE_PARAMS if n in space.params and n not in fixed]
    for cand in space.grid(fixed, names=RULE_PARAMS):
        cand = derive(cand, recipe)
        broken = violations(cand, recipe, extra_rules)
        if broken:
            blocking[_rule_kind(broken[0])] += 1
        else:
            valid.append({n: cand[n] for n in names})
    return valid, blocking


def forced_values(space: Space, valid: list[dict[str, Any]]) -> dict[str, Any]:
    """Parameters that have a single valid value (ZeRO 0 on CPU, vLLM TP 1 on one GPU): fixing
    them keeps the sampler from spending proposals on values that can never run."""
    forced: dict[str, Any] = {}
    if not valid:
        return forced
    for name in valid[0]:
        values = {repr(c[name]) for c in valid}
        if len(values) == 1 and len(space.params[name].grid_values()) > 1:
            forced[name] = valid[0][name]
    return forced


def check_pins_leave_candidates(space: Space, recipe: Recipe, fixed: dict[str, Any],
                                extra_rules: Iterable[Callable[[dict[str, Any]], str | None]] = ()
                                ) -> int:
    """Count valid discrete candidates; raise a one-line error naming the rule when none is left."""
    combos, blocking = valid_combinations(space, recipe, fixed, extra_rules)
    valid = len(combos)
    if valid == 0:
        shown = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "the space as it is"
        reason = blocking.most_common(1)[0][0] if blocking else "no candidates"
        raise UsageError(f"no valid candidate is left with {shown}: {reason}; change the pins "
                         "(--set / --global-batch) or widen the space")
    return valid


def _rule_kind(message: str) -> str:
    """Collapse a violation to its rule so that counts group by rule, not by number."""
    for key, kind in (
        ("global batch", "--global-batch must be divisible by per-device batch x data-parallel GPUs"),
        ("generation batch", "the generation batch (per-device batch x GPUs x accumulation or "
                             "steps_per_generation) must be divisible by num_generations"),
        ("generation_batch_size", "generation_batch_size must be divisible by the global micro-batch, "
                                  "and not set together with steps_per_generation"),
        ("at least 2", "num_generations must be at least 2"),
        ("optimizer offload", "optimizer offload needs ZeRO stage >= 2"),
        ("parameter offload", "parameter offload needs ZeRO stage 3"),
        ("tensor parallel", "vLLM tensor parallel size must divide the GPUs"),
    ):
        if key in message:
            return kind
    return message
