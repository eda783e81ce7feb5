"""What one candidate would cost under a recipe: its memory estimate and its speed prior.

The memory model and the speed prior read TRL's names and take the recipe's lengths, GPUs,
quantization and images as arguments. Both the planner (before each trial) and ``autotune
estimate`` (the what-if calculator) go through here, so they cannot disagree about a candidate:
the space's own batch names and ms-swift's ``sleep_level`` are read as TRL's (``as_trl``) first,
then every recipe argument is passed the same way.
"""

from __future__ import annotations

from typing import Any

from autotune.candidate.constraints import as_trl
from autotune.candidate.footprint import base_quantization
from autotune.candidate.memory import Estimate, estimate
from autotune.candidate.space import Space
from autotune.candidate.speed import throughput_prior
from autotune.hardware import GpuType
from autotune.models import ModelSpec
from autotune.recipe import Recipe


def estimate_for(
    model: ModelSpec, recipe: Recipe, params: dict[str, Any], space: Space | None = None
) -> Estimate:
    """The uncalibrated memory estimate of ``params`` (in the space's names) per GPU.

    ``space`` is the candidate's space when the caller holds it; else the recipe's is loaded."""
    params = as_trl(params, recipe, space)
    return estimate(
        model,
        params,
        gpus=recipe.gpus,
        capacity_gib=recipe.gpu_memory_gib,
        max_prompt_length=recipe.max_prompt_length,
        max_completion_length=recipe.max_completion_length,
        beta=recipe.beta,
        lora_rank=recipe.lora_rank,
        dp_gpus=recipe.dp_gpus(params),
        quantization=recipe.quantization,
        image_tokens=recipe.image_tokens,
        images_per_prompt=recipe.images_per_prompt,
    )


#: Runners whose trainer calls transformers' generate once per generation round: TRL and the
#: simulator of TRL (docs/gpu-validation.md, fourth lease). ms-swift's engine is not read here.
TRL_GENERATE = frozenset({"trl", "sim"})


def prior_for(model: ModelSpec, recipe: Recipe, gpu: GpuType, params: dict[str, Any]) -> float:
    """The speed prior of ``params`` (completions per second), read through the same names."""
    # Known gap: a space that sizes vLLM without a use_vllm switch (a PPO trainer whose vLLM always
    # runs) is read with TRL's default, no vLLM, so a --command trainer's generation goes in waves of
    # the micro-batch. Reading it as vLLM's cost the benchmark's PPO runs 9 of 93 at 0.95, and the
    # waves' removal with only the launch floor an H200 measured 9 of 62: the wrong reading stands in
    # for a micro-batch efficiency far steeper than the GPU's (docs/benchmarks-notes.md, twentieth
    # and twenty-first passes).
    params = as_trl(params, recipe)
    return throughput_prior(
        model,
        params,
        gpu,
        gpus=recipe.gpus,
        dp_gpus=recipe.dp_gpus(params),
        prompt=recipe.max_prompt_length,
        completion=recipe.max_completion_length,
        beta=recipe.beta,
        quant=base_quantization(model, recipe.quantization, recipe.lora_rank),
        per_round=recipe.runner in TRL_GENERATE,
    )
