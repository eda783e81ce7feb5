"""What one simulated trial would show: the landscape's result types and its OOM-message numbers.

``Failure`` uses outcome.json's words so that the trainer's texts and autotune's classifier agree;
``oom_numbers`` makes the figures of PyTorch's allocator message consistent with the demand that
killed the trial, so that a parser reading them sees a believable story.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from autotune.units import GIB


class Failure(NamedTuple):
    """How a trial dies.

    kind: ``cuda`` | ``host`` | ``vllm_kv`` | ``vllm_startup`` | ``invalid`` (the same words as
    outcome.json's ``oom_kind``, plus ``invalid`` for TRL's own config checks).
    at_step: 0 = during start-up (nothing logged yet); k >= 1 = during optimizer step k, so steps
    1..k-1 completed and were logged.
    message_kind: which error text the trainer prints (see ``error_text.py``).
    """

    kind: str
    at_step: int
    message_kind: str


@dataclass
class TrialTruth:
    """What one trial would show. Lists hold one entry per *completed* optimizer step."""

    startup_s: float
    step_times: list[float]
    generation_times: list[float]
    training_times: list[float]
    peak_memory_gib: list[float]  # per step, max over the trial's GPUs (not cumulative)
    startup_peak_gib: float  # after model states and vLLM are up, before step 1
    failure: Failure | None
    samples_per_step: int  # completions trained per optimizer step
    tokens_per_step: int  # prompt + completion tokens per optimizer step
    capacity_gib: float
    max_steps: int
    fail_after_s: float = 0.0  # simulated seconds into the failing phase (start-up or step)
    info: dict[str, Any] = field(default_factory=dict)  # numbers for log lines and error texts

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def peak_gib(self) -> float:
        """Largest memory seen over the whole trial (what NVML sampling would report)."""
        return max([self.startup_peak_gib, *self.peak_memory_gib])

    def steady_step_time(self, warmup: int = 2) -> float | None:
        """Mean step time after the warm-up steps (falls back to all steps when too few)."""
        times = self.step_times[warmup:] or self.step_times
        return sum(times) / len(times) if times else None

    def throughput(self, warmup: int = 2) -> float | None:
        """Completions per second in steady state; None for a failed trial."""
        if self.failure is not None:
            return None
        t = self.steady_step_time(warmup)
        return self.samples_per_step / t if t else None


def oom_numbers(
    rng: random.Random, cap_gib: float, demand: float, alloc: float, non_torch: float, unalloc: float
) -> dict[str, float]:
    """Numbers for PyTorch's OOM message that agree with each other and with the demand:
    what was in use before the failing allocation, and a free amount smaller than it."""
    cap = cap_gib * GIB
    alloc = max(alloc, 0.02 * GIB)
    used = min(demand - alloc, cap - rng.uniform(0.01, 0.06) * GIB)
    free = cap - used
    alloc = max(alloc, free + 0.01 * GIB)
    reserved = max(used - non_torch, 0.0)
    unalloc = min(max(unalloc, 0.02 * GIB), reserved * 0.3)
    return {
        "tried_gib": alloc / GIB,
        "capacity_gib": cap_gib,
        "free_gib": free / GIB,
        "in_use_gib": used / GIB,
        "allocated_gib": (reserved - unalloc) / GIB,
        "unallocated_gib": unalloc / GIB,
        "gpu": 0,
    }
