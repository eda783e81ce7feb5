"""What the benchmark's other trainer families share: their environment, the step loop, the texts.

A family is a trainer written apart from the GRPO simulator, in its own knob names and with its own
functional forms, so that a search cannot do well by knowing one simulator's constants. Each one
maps (parameters, environment, seed) to a ``TrialTruth`` and the text the trainer would print when
it dies; autotune's real classifier reads that text (``replay.FamilyExecutor``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from autotune.sim.error_cuda import nccl_timeout_text
from autotune.sim.error_frames import cuda_oom_message
from autotune.sim.physics import Physics
from autotune.sim.truth import Failure, TrialTruth, oom_numbers
from autotune.units import GIB

WATCHDOG_S = 600.0  # torch's default NCCL timeout: what a hung collective costs before it dies


@dataclass(frozen=True)
class Env:
    """The fixed side of a family's landscape: hardware, model, lengths, batch and physics."""

    gpus: int
    gpu_gib: float
    tflops: float
    params_b: float
    hidden: int
    layers: int
    vocab: int
    prompt: int
    completion: int
    global_batch: int
    physics: Physics = field(default_factory=Physics)
    logs_memory: bool = True  # False: the trainer logs no peak (and nothing samples NVML)
    extra: dict[str, float] = field(default_factory=dict)  # a family's own hidden constants


def trial_rng(params: dict[str, Any], seed: int, salt: str) -> random.Random:
    """Noise keyed by seed and configuration, like two real runs of two configurations."""
    key = json.dumps([salt, seed, params], sort_keys=True, default=str)
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))


@dataclass
class Plan:
    """One trial's physics before noise: start-up, per-step time and memory, and the demand that
    decides an OOM (bytes per GPU)."""

    startup_s: float
    step_s: float
    samples: int
    peak: float  # bytes in steady state, before creep
    creep: float  # fraction of the peak the allocator creeps by over the first steps
    logged: bool = True


def play(plan: Plan, env: Env, rng: random.Random, crash_rng: random.Random, max_steps: int) -> TrialTruth:
    """Warm-up, noise, creep into an OOM, a transient NCCL crash; the truth of the trial."""
    ph, cap = env.physics, env.gpu_gib * GIB
    run_factor = math.exp(rng.gauss(0.0, ph.noise))
    crash_at = crash_rng.randint(1, min(max_steps, 8)) if crash_rng.random() < ph.crash_rate else 0
    times: list[float] = []
    peaks: list[float] = []
    failure, fail_after, info = None, 0.0, {}
    for step in range(1, max_steps + 1):
        warm = rng.uniform(1.3, 1.6) if step == 1 else (rng.uniform(1.05, 1.12) if step == 2 else 1.0)
        t = plan.step_s * warm * run_factor * math.exp(rng.gauss(0.0, ph.step_sigma))
        grown = plan.peak * (1.0 + plan.creep * (1.0 - math.exp(-step / 4.0)))
        peak = grown + abs(rng.gauss(0.0, 0.04)) * GIB
        if peak > cap:
            info["oom"] = oom_numbers(
                rng, env.gpu_gib, peak, alloc=0.3 * GIB, non_torch=0.6 * GIB, unalloc=0.1 * GIB
            )
            failure, fail_after = Failure("cuda", step, "cuda_oom"), t * 0.6
            break
        if step == crash_at:
            info["nccl_seq"] = 40 * step + crash_rng.randint(0, 39)
            failure, fail_after = Failure("transient", step, "nccl_timeout"), t + WATCHDOG_S
            break
        times.append(t)
        peaks.append(peak / GIB)
    return TrialTruth(
        startup_s=plan.startup_s,
        step_times=times,
        generation_times=[0.0] * len(times),
        training_times=list(times),
        peak_memory_gib=peaks,
        startup_peak_gib=0.0,
        failure=failure,
        samples_per_step=plan.samples,
        tokens_per_step=plan.samples * (env.prompt + env.completion),
        capacity_gib=env.gpu_gib,
        max_steps=max_steps,
        fail_after_s=fail_after,
        info={**info, "logs_memory": plan.logged},
    )


def dies_at_start(
    env: Env, kind: str, message_kind: str, startup_s: float, info: dict[str, Any]
) -> TrialTruth:
    """A trial that fails before its first step."""
    return TrialTruth(
        startup_s=startup_s,
        step_times=[],
        generation_times=[],
        training_times=[],
        peak_memory_gib=[],
        startup_peak_gib=0.0,
        failure=Failure(kind, 0, message_kind),
        samples_per_step=0,
        tokens_per_step=0,
        capacity_gib=env.gpu_gib,
        max_steps=0,
        info=info,
    )


def failure_text(truth: TrialTruth, env: Env, program: str) -> str:
    """What a family's trainer prints when it dies (the real libraries' wording)."""
    f, info = truth.failure, truth.info
    assert f is not None
    if f.kind == "transient":
        return nccl_timeout_text(int(info.get("nccl_seq", 1041)), env.gpus)
    head = f'Traceback (most recent call last):\n  File "{program}", line 212, in <module>\n    main()\n'
    if f.kind == "vllm_startup":
        util, free = info["util"], info["free_gib"]
        return head + (
            f"ValueError: Free memory on device ({free:.2f}/{env.gpu_gib:.2f} GiB) on startup is less than "
            f"desired GPU memory utilization ({util}, {util * env.gpu_gib:.2f} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes.\n"
        )
    if f.kind == "vllm_kv":
        return head + (
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine.\n"
        )
    if f.kind == "invalid":
        return head + f"ValueError: {info.get('invalid', 'invalid configuration')}\n"
    return head + "torch.OutOfMemoryError: " + cuda_oom_message(info["oom"]) + "\n"
