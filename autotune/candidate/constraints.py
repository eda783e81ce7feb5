"""Rules a candidate must obey before anything is launched.

These are TRL's own validation rules (GRPOConfig.__post_init__), DeepSpeed's offload rules and
vLLM's tensor-parallel rule, checked in-process in microseconds. A candidate that breaks one is
recorded as invalid and told to Optuna as infeasible, so it costs no GPU time and teaches the
sampler to stay away. Runners may add rules of their own (e.g. a package that is not installed).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from autotune.candidate.batch import (
    GlobalBatch,
    accumulation_for,
    completions_per_step,
    generation_batch_of,
    mapping,
)
from autotune.candidate.defaults import TRL_DEFAULTS, knob
from autotune.candidate.space import Space
from autotune.candidate.space_file import load_space
from autotune.candidate.space_rules import GPUS
from autotune.errors import UsageError
from autotune.recipe import Recipe

# Parameters the rules look at; exhaustive checks enumerate only these.
RULE_PARAMS = [
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "zero_stage",
    "offload",
    "use_vllm",
    "vllm_mode",
    "vllm_tensor_parallel_size",
    "steps_per_generation",
    "generation_batch_size",
]


def space_of(recipe: Recipe) -> Space | None:
    """The space the recipe names (``recipe.space``, filled by ``search``), loaded once.

    The rules are called from many places with only a candidate and the recipe; the recipe names
    its space, so the global-batch mapping comes from there. Callers that hold the Space pass it.
    None when the file cannot be read any more: the candidate's own names decide then.
    """
    try:
        return _load(recipe.space or "", recipe.space_digest)
    except UsageError:
        return None


@functools.lru_cache(maxsize=8)
def _load(path: str, digest: str) -> Space:
    return load_space(path or None)


def batch_of(params: dict[str, Any], recipe: Recipe, space: Space | None = None) -> GlobalBatch | None:
    """How this candidate's parameters make the global batch: the space's mapping, else TRL's
    names when the candidate has them, else None (nothing is known about the batch)."""
    space = space if space is not None else space_of(recipe)
    return mapping(space.batch if space is not None else None, params)


def samples_per_step(params: dict[str, Any], recipe: Recipe, space: Space | None = None) -> int | None:
    """Completions one optimizer step of this candidate trains, read through the space's batch
    mapping (None when nothing says: the trial's metrics must then count them)."""
    return completions_per_step(params, recipe, batch_of(params, recipe, space))


def derive(params: dict[str, Any], recipe: Recipe, space: Space | None = None) -> dict[str, Any]:
    """Fill derived values: the accumulation from ``--global-batch`` when one is given.

    Returns a new dict; when the global batch does not divide, accumulation is left as 0 so that
    ``violations`` reports it. A space with its own names declares which parameter accumulates
    (``global_batch:`` in the space); TRL's batch names, which the search puts beside candidates
    (``gradient_accumulation_steps`` under ``--global-batch``, None in seeds), are dropped from a
    space that has its own names or leaves them empty.
    """
    out = dict(params)
    space = space if space is not None else space_of(recipe)
    batch = batch_of(out, recipe, space)
    if space is not None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if name not in space.params and (
                (batch is not None and batch.declared) or out.get(name, 0) is None
            ):
                out.pop(name, None)
    if (
        recipe.global_batch
        and batch is not None
        and batch.accumulation is not None
        and out.get(batch.micro_batch) is not None
    ):
        per_micro = int(out[batch.micro_batch]) * batch.gpus_factor(recipe.dp_gpus(out))
        out[batch.accumulation] = accumulation_for(recipe.global_batch, per_micro) or 0
    return out


def as_trl(params: dict[str, Any], recipe: Recipe, space: Space | None = None) -> dict[str, Any]:
    """The candidate with TRL's batch names filled from the space's own (per-GPU micro-batch,
    accumulation, group size), for code that reads TRL's names: the memory model, the speed prior.
    ms-swift's ``sleep_level`` is read as TRL's sleep mode. Its ``offload_model`` /
    ``offload_optimizer`` (states moved to the CPU while vLLM generates) are not modelled: the
    generation phase's peak is over-estimated with them, never under-estimated."""
    out = dict(params)
    if out.get("sleep_level") is not None:  # ms-swift: level 1 or 2 puts vLLM to sleep while training
        out["vllm_enable_sleep_mode"] = int(out["sleep_level"]) >= 1
    batch = batch_of(out, recipe, space)
    if batch is None or not batch.declared or out.get(batch.micro_batch) is None:
        return out
    dp = recipe.dp_gpus(out)
    micro = int(out[batch.micro_batch])
    out["per_device_train_batch_size"] = micro if batch.per == "gpu" else max(micro // max(dp, 1), 1)
    out["gradient_accumulation_steps"] = batch.accumulation_of(out, dp, recipe.global_batch) or 1
    if batch.generations is not None and out.get(batch.generations) is not None:
        out["num_generations"] = int(out[batch.generations])
    return out


def check_batch(space: Space, recipe: Recipe) -> None:
    """``--global-batch`` needs to know which parameters make the batch: refuse, in one line, a
    space that neither uses TRL's names nor declares its own."""
    if recipe.global_batch and space.batch is None:
        ints = [n for n, p in space.params.items() if p.type == "int"]
        raise UsageError(
            f"--global-batch {recipe.global_batch}: the space {space.path} "
            "does not say which parameters make "
            "the batch; declare them at its top level, e.g. 'global_batch: {micro_batch: NAME, accumulation: "
            f"NAME, per: gpu}}' (its int parameters: {', '.join(ints) or 'none'}), or drop --global-batch"
        )


def pin(recipe: Recipe, space: Space, raw: dict[str, str], what_if: bool = False) -> list[str]:
    """Read ``--set`` pins into ``recipe.pins``, for a search (every pin inside the space) or, with
    ``what_if``, for ``autotune estimate`` (any value of the parameter's type; the ones outside the
    space come back as warnings). A wrong type, an unknown name or an accumulation pinned beside
    ``--global-batch`` (which derives it) is bad input."""
    pins = {**recipe.pins, **space.read_pins(raw)}
    warnings = space.outside(pins) if what_if else []
    if not what_if:
        space.check_pins(pins)
    if recipe.global_batch and "gradient_accumulation_steps" in pins:
        raise UsageError("--global-batch derives gradient_accumulation_steps: do not also --set it")
    recipe.pins = pins
    return warnings


def violations(
    params: dict[str, Any],
    recipe: Recipe,
    extra_rules: Iterable[Callable[[dict[str, Any]], str | None]] = (),
    space: Space | None = None,
) -> list[str]:
    """Every broken rule as a short sentence; empty when the candidate may be launched.

    The batch rules look at the parameters that make the batch: TRL's names, or the ones the space
    declares. A space that names neither gets no batch rule (nothing is known to check).
    """
    out: list[str] = []
    space = space if space is not None else space_of(recipe)
    batch = batch_of(params, recipe, space)
    gens_name = batch.generations if batch and batch.generations else "num_generations"
    gens = _int(params, gens_name, None)
    dp = recipe.dp_gpus(params)
    use_vllm = bool(knob(params, "use_vllm"))
    mode = knob(params, "vllm_mode")
    tp = _int(params, "vllm_tensor_parallel_size", 1)
    stage = _int(params, "zero_stage", 0)
    offload = params.get("offload", "none")

    if dp < 1:
        out.append(f"vLLM server mode with tensor parallel {tp} leaves no GPU of {recipe.gpus} to train on")
        return out
    if batch is not None:
        trl = not batch.declared
        micro = _int(params, batch.micro_batch, TRL_DEFAULTS["per_device_train_batch_size"] if trl else None)
        per_micro = micro * batch.gpus_factor(dp) if micro else None
        derived = params.get(batch.accumulation) if batch.accumulation else None
        if recipe.global_batch and per_micro and (recipe.global_batch % per_micro or derived == 0):
            what = "per-device batch" if trl else batch.micro_batch
            gpus = f"{dp} data-parallel GPUs" if batch.per == "gpu" else "all GPUs together"
            out.append(f"global batch {recipe.global_batch} is not divisible by {what} {micro} x {gpus}")
            return out
        if trl:
            gens = TRL_DEFAULTS["num_generations"] if gens is None else gens
            # ms-swift's GRPO arguments take both generation knobs when they agree; TRL's refuse
            generation_batch, how = generation_batch_of(params, dp, both=recipe.runner == "swift")
        else:
            generation_batch = batch.completions(params, dp, recipe.global_batch)
            steps = batch.accumulation_of(params, dp, recipe.global_batch)
            how = (
                f"{batch.micro_batch} {micro} x {batch.gpus_factor(dp)} GPU(s) x "
                f"{batch.accumulation or 'accumulation'} {steps}"
            )
        if generation_batch is None:
            out.append(how)
        elif gens is not None and gens >= 2 and generation_batch % gens:
            name = "num_generations" if trl else batch.generations
            out.append(f"generation batch {generation_batch} (= {how}) is not divisible by {name} {gens}")
    # GRPO's rule: a group of one has no baseline. It belongs to GRPO trainers (TRL's and ms-swift's
    # num_generations), not to a space in its own names, whose trainer may be PPO (1 sample a prompt)
    if gens is not None and gens < 2 and gens_name == "num_generations":
        out.append("num_generations must be at least 2 (GRPO needs 2 completions per prompt)")
    if offload not in ("none", "optimizer", "optimizer+params"):
        out.append(f"offload '{offload}' is not none, optimizer or optimizer+params")
    if offload == "optimizer" and stage < 2:
        out.append(f"optimizer offload needs ZeRO stage 2 or 3, not {stage}")
    if offload == "optimizer+params" and stage != 3:
        out.append(f"parameter offload needs ZeRO stage 3, not {stage}")
    if use_vllm:
        if mode == "server":
            if tp >= recipe.gpus:
                out.append(
                    f"vLLM server mode needs GPUs left to train: tensor parallel {tp} of {recipe.gpus}"
                )
        elif tp > recipe.gpus or recipe.gpus % tp:
            out.append(f"vLLM tensor parallel size {tp} must divide the {recipe.gpus} GPU(s)")
        util = params.get("vllm_gpu_memory_utilization")
        if mode == "colocate" and util is not None and not 0.0 < float(util) < 1.0:
            out.append(f"vllm_gpu_memory_utilization {util} must be between 0 and 1")
    for rule in extra_rules:
        message = rule(params)
        if message:
            out.append(message)
    if space is not None and space.rules:
        # as the candidate is launched: a knob `requires` drops takes its default, as in the command
        values = {**space.defaults(), **space.normalize(params), GPUS: recipe.gpus}
        out.extend(f"breaks the space's rule {r.text}" for r in space.rules if not r.holds(values))
    return out


def _int(params: dict[str, Any], name: str, default: int | None) -> int | None:
    """A count from the candidate; a missing or None value (a knob the space lacks) is the default."""
    value = params.get(name)
    return default if value is None else int(value)


def valid_combinations(
    space: Space,
    recipe: Recipe,
    fixed: dict[str, Any],
    extra_rules: Iterable[Callable[[dict[str, Any]], str | None]] = (),
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """Every valid combination of the parameters the rules look at (the rest at defaults), and
    how often each rule blocked one. Stays in the tens of thousands even for wide spaces."""
    extra_rules = list(extra_rules)
    blocking: Counter[str] = Counter()
    valid: list[dict[str, Any]] = []
    batch = space.batch
    looked_at = RULE_PARAMS + (
        [n for n in (batch.micro_batch, batch.accumulation, batch.generations) if n and n not in RULE_PARAMS]
        if batch is not None
        else []
    )
    # the knobs a space's rules read, where each is discrete: a float's grid is three points, not its
    # range, so a rule reading one is checked on each candidate alone, not here (nor is it forced)
    discrete = tuple(
        r for r in space.rules if all(n == GPUS or space.params[n].choices is not None for n in r.names)
    )
    space = replace(space, rules=discrete)
    looked_at += sorted({n for r in discrete for n in r.names} - {GPUS} - set(looked_at))
    names = [n for n in looked_at if n in space.params and n not in fixed]
    for cand in space.grid(fixed, names=looked_at):
        cand = derive(cand, recipe, space)
        broken = violations(cand, recipe, extra_rules, space)
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


def check_pins_leave_candidates(
    space: Space,
    recipe: Recipe,
    fixed: dict[str, Any],
    extra_rules: Iterable[Callable[[dict[str, Any]], str | None]] = (),
) -> int:
    """Count valid discrete candidates; raise a one-line error naming the rule when none is left
    (or, first, when ``--global-batch`` is given to a space that does not say what makes the batch)."""
    check_batch(space, recipe)
    combos, blocking = valid_combinations(space, recipe, fixed, extra_rules)
    valid = len(combos)
    if valid == 0:
        derived = space.batch.accumulation if recipe.global_batch and space.batch is not None else None
        shown = (
            ", ".join(f"{k}={v}" for k, v in fixed.items() if k in space.params and k != derived)
            or "the space as it is"
        )
        reason = blocking.most_common(1)[0][0] if blocking else "no candidates"
        raise UsageError(
            f"no valid candidate is left with {shown}: {reason}; change the pins "
            "(--set / --global-batch) or widen the space"
        )
    return valid


def _rule_kind(message: str) -> str:
    """Collapse a violation to its rule so that counts group by rule, not by number."""
    for key, kind in (
        ("global batch", "--global-batch must be divisible by the micro-batch x data-parallel GPUs"),
        (
            "generation batch",
            "the generation batch (micro-batch x GPUs x accumulation or "
            "steps_per_generation) must be divisible by num_generations",
        ),
        (
            "generation_batch_size",
            "generation_batch_size must be divisible by the global micro-batch, "
            "and not set together with steps_per_generation",
        ),
        ("at least 2", "num_generations must be at least 2"),
        ("optimizer offload", "optimizer offload needs ZeRO stage >= 2"),
        ("parameter offload", "parameter offload needs ZeRO stage 3"),
        ("tensor parallel", "vLLM tensor parallel size must divide the GPUs"),
    ):
        if key in message:
            return kind
    return message
