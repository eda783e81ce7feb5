"""A candidate as a vector of knobs, each oriented so that larger means more GPU memory per GPU.

What trials have shown is compared in this space: a candidate at least as large as a measured
OOM in every knob will OOM too, one no larger than a measured success fits (the planner's
dominance), and the nearest measured trials correct the speed prior (:func:`distance`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from autotune.candidate.batch import generation_sequences
from autotune.candidate.defaults import knob

OFFLOAD_RANK = {"none": 2, "optimizer": 1, "optimizer+params": 0}  # higher = more GPU memory
#: Knobs compared on a log scale in :func:`distance`: doubling counts the same at every size.
LOG_SCALED = frozenset({"micro_batch", "generation_sequences"})
#: Knobs that weigh more than 1 per unit in :func:`distance`: a vLLM fraction spans 0..1, so one
#: tenth of it counts as much as 0.4 of a ZeRO stage.
DISTANCE_WEIGHTS = {"vllm_fraction": 4.0}
TOLERANCE = 1e-9  # float noise in :func:`at_least`


class MemoryVector(NamedTuple):
    """The knobs, larger = more memory per GPU (so ZeRO stage, TP and dp are negated)."""

    micro_batch: float
    zero_stage: float  # -stage
    offload: float  # OFFLOAD_RANK
    recompute: float  # 0 with gradient checkpointing, 1 without
    colocated: float  # 1 with vLLM in the trainer's GPUs
    vllm_fraction: float  # its gpu_memory_utilization when colocated
    awake: float  # 0 when colocated vLLM sleeps while training
    vllm_tp: float  # -tensor parallel size when colocated
    generation_sequences: float  # one generate() call's sequences without vLLM
    dp: float  # -data-parallel GPUs (ZeRO shards over them)


def memory_vector(params: dict[str, Any], dp: int = 1) -> MemoryVector:
    """Each knob oriented so that larger means more GPU memory per GPU.

    num_generations does not change the peak (TRL's micro-batch counts completions); accumulation
    does only without vLLM, where one ``generate()`` call decodes batch x steps_per_generation
    sequences (:func:`autotune.candidate.batch.generation_sequences`). ``dp`` is the
    data-parallel size: ZeRO shards states over it, so fewer training GPUs (vLLM server mode)
    means more memory on each.
    """
    colocated = bool(params.get("use_vllm")) and knob(params, "vllm_mode") == "colocate"
    return MemoryVector(
        micro_batch=float(knob(params, "per_device_train_batch_size")),
        zero_stage=-float(params.get("zero_stage", 0)),
        offload=float(OFFLOAD_RANK.get(params.get("offload", "none"), 2)),
        recompute=0.0 if knob(params, "gradient_checkpointing") else 1.0,
        colocated=1.0 if colocated else 0.0,
        vllm_fraction=float(params.get("vllm_gpu_memory_utilization", 0.0)) if colocated else 0.0,
        awake=0.0 if (colocated and params.get("vllm_enable_sleep_mode")) else 1.0,
        vllm_tp=-float(knob(params, "vllm_tensor_parallel_size")) if colocated else 0.0,
        generation_sequences=float(generation_sequences(params, dp)),
        dp=-float(dp),
    )


def distance(a: MemoryVector, b: MemoryVector) -> float:
    """How far apart two candidates are in knob space: log2 steps for the sizes, weighted units
    for the rest."""
    return sum(
        abs(math.log2(x) - math.log2(y))
        if name in LOG_SCALED and x > 0 and y > 0
        else abs(x - y) * DISTANCE_WEIGHTS.get(name, 1)
        for name, x, y in zip(MemoryVector._fields, a, b)
    )


def at_least(a: MemoryVector, b: MemoryVector) -> bool:
    """Whether ``a`` needs at least the memory of ``b`` in every knob."""
    return all(x >= y - TOLERANCE for x, y in zip(a, b))
