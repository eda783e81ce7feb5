"""The global batch: which knobs make it, and what they multiply to.

Completions per optimizer step = micro-batch x accumulation x data-parallel GPUs, in TRL's names
or in the names a space declares (its ``global_batch:`` block); the generation batch and the
sequences one ``generate()`` call decodes follow from the same knobs. Every reader of a candidate's
batch (the rules, the memory model, the speed prior, the trial's throughput, the export) asks
here, and a knob the candidate lacks takes TRL's default from :mod:`autotune.candidate.defaults`.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from autotune.candidate.defaults import TRL_DEFAULTS, knob
from autotune.recipe import Recipe


def accumulation_for(global_batch: int, per_micro: int) -> int | None:
    """Micro-steps that make ``global_batch`` from ``per_micro`` completions each; None when it
    does not divide (the rules then refuse the candidate)."""
    return global_batch // per_micro if global_batch % per_micro == 0 else None


@dataclass(frozen=True)
class GlobalBatch:
    """Which parameters make the global batch (completions per optimizer step), by name.

    TRL's names need no declaration; a trainer with its own names (OpenRLHF's
    ``micro_train_batch_size``) declares them in the space's ``global_batch:`` block, so that
    ``--global-batch`` can derive the accumulation and the rules look at the right knobs:
    completions per step = micro_batch x accumulation (1 when not named) x data-parallel GPUs (x 1
    with ``per: all``). ``generations`` is the group size: a step must hold whole groups.
    """

    micro_batch: str
    accumulation: str | None = None
    per: str = "gpu"
    generations: str | None = None
    declared: bool = False  # written in the space, not TRL's names taken as they are

    def gpus_factor(self, dp: int) -> int:
        """GPUs the micro-batch is multiplied by: the data-parallel ones, or 1 with ``per: all``."""
        return max(dp, 1) if self.per == "gpu" else 1

    def accumulation_of(self, params: dict[str, Any], dp: int, global_batch: int | None) -> int | None:
        """Micro-steps per optimizer step: the parameter's value, the one ``--global-batch`` implies
        when the trainer derives it itself (no accumulation parameter), or 1; None when the global
        batch does not divide."""
        if self.accumulation is not None and params.get(self.accumulation) is not None:
            return int(params[self.accumulation])
        if global_batch:
            return accumulation_for(global_batch, int(params[self.micro_batch]) * self.gpus_factor(dp))
        return 1

    def completions(self, params: dict[str, Any], dp: int, global_batch: int | None = None) -> int | None:
        """Completions per optimizer step, or None when the candidate does not say (no micro-batch)."""
        if params.get(self.micro_batch) is None:
            return None
        accumulation = self.accumulation_of(params, dp, global_batch)
        if accumulation is None:
            return None
        return int(params[self.micro_batch]) * accumulation * self.gpus_factor(dp)


TRL_BATCH = GlobalBatch(
    micro_batch="per_device_train_batch_size",
    accumulation="gradient_accumulation_steps",
    per="gpu",
    generations="num_generations",
)


def mapping(declared: GlobalBatch | None, names: Container[str]) -> GlobalBatch | None:
    """How a candidate's knobs make the global batch: the space's declared block, else TRL's names
    when ``names`` (a space's parameters, or a candidate's) has TRL's micro-batch, else None
    (nothing is known about the batch)."""
    if declared is not None:
        return declared
    return TRL_BATCH if "per_device_train_batch_size" in names else None


def completions_per_step(
    params: dict[str, Any], recipe: Recipe, batch: GlobalBatch | None = None
) -> int | None:
    """Completions trained per optimizer step: micro-batch x accumulation x data-parallel GPUs.

    ``batch`` is the space's ``GlobalBatch`` (``Space.batch``) when the trainer has its own names.
    Without it TRL's names are read, and a candidate without them trains ``--global-batch``
    completions when one is given, or an unknown number (None: the trial's metrics must then say
    how many samples a step trained).
    """
    if batch is not None:
        return batch.completions(params, recipe.dp_gpus(params), recipe.global_batch)
    if params.get("per_device_train_batch_size") is not None:
        accumulation = params.get("gradient_accumulation_steps")
        return (
            int(params["per_device_train_batch_size"])
            * int(1 if accumulation is None else accumulation)
            * recipe.dp_gpus(params)
        )
    return recipe.global_batch or None


def trl_completions(params: dict[str, Any], dp: int) -> int:
    """Completions per optimizer step in TRL's names, TRL's defaults for what the candidate lacks
    (the speed prior's count, after ``as_trl`` has filled TRL's names)."""
    return (
        int(knob(params, "per_device_train_batch_size"))
        * int(knob(params, "gradient_accumulation_steps"))
        * dp
    )


def _count(params: dict[str, Any], name: str) -> int | None:
    """A count from the candidate; a missing or None value (a knob the space lacks) is TRL's default."""
    value = params.get(name)
    return TRL_DEFAULTS[name] if value is None else int(value)


def generation_batch_of(params: dict[str, Any], dp: int, both: bool = False) -> tuple[int | None, str]:
    """Completions generated per generation round, as TRL's GRPOConfig derives it, and how.

    A space may set ``steps_per_generation`` or ``generation_batch_size`` (TRL refuses both; ms-swift,
    ``both=True``, takes both when they agree); without either TRL generates once per optimizer step
    (steps_per_generation = accumulation). Returns (None, the reason) for what the trainer refuses.
    """
    pdbs = _count(params, "per_device_train_batch_size") or TRL_DEFAULTS["per_device_train_batch_size"]
    spg, gbs = params.get("steps_per_generation"), params.get("generation_batch_size")
    if spg is not None and gbs is not None:
        if not both:
            return None, "generation_batch_size and steps_per_generation cannot both be set (TRL refuses it)"
        if int(gbs) != pdbs * dp * int(spg):
            return None, (
                f"generation_batch_size {gbs} must equal {pdbs} per device x {dp} GPUs x "
                f"steps_per_generation {spg} (ms-swift refuses it otherwise)"
            )
        return int(gbs), f"generation_batch_size {gbs}"
    if gbs is not None:
        if int(gbs) % (pdbs * dp):
            return None, (
                f"generation_batch_size {gbs} is not divisible by the global micro-batch "
                f"{pdbs * dp} (= {pdbs} per device x {dp} GPUs)"
            )
        return int(gbs), f"generation_batch_size {gbs}"
    steps = (_count(params, "gradient_accumulation_steps") or 0) if spg is None else int(spg)
    what = "accumulation" if spg is None else "steps_per_generation"
    return pdbs * dp * steps, f"{pdbs} per device x {dp} GPUs x {steps} {what}"


def generation_sequences(params: dict[str, Any], dp: int) -> int:
    """Sequences one ``generate()`` call decodes per GPU without vLLM (0 with vLLM): TRL's local
    generation batch, per-device batch x steps_per_generation (accumulation unless the space sets
    steps_per_generation, or generation_batch_size / data-parallel GPUs)."""
    if params.get("use_vllm"):
        return 0
    if params.get("generation_batch_size") is not None:
        return -(-int(params["generation_batch_size"]) // max(dp, 1))
    steps = params.get("steps_per_generation")
    steps = int(knob(params, "gradient_accumulation_steps") if steps is None else steps)
    return int(knob(params, "per_device_train_batch_size")) * max(steps, 1)
