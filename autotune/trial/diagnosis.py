"""Why a trial's GPUs were idle: the one-line diagnosis behind ``low_util``.

Why a module of its own: the rules read the trial's parameters (TRL's, DeepSpeed's and ms-swift's
knobs) and its phase times, not the samples; :mod:`autotune.trial.utilization` reduces the samples
to a mean and a share of idle time and asks here what they mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from autotune.trial.layout import GPU_CSV, STDOUT

__all__ = [
    "diagnose_low_util",
    "number",
    "GENERATION_BOUND_SHARE",
    "SMALL_VLLM_FRACTION",
    "CPU_BOUND_PCT_PER_GPU",
    "IDLE_SHARE_LIMIT",
    "SWIFT_KNOBS",
]

# Thresholds of the low-utilization diagnosis (see diagnose_low_util for why these values).
GENERATION_BOUND_SHARE = 0.6  # generation time / (generation + training) above this: generation-bound
SMALL_VLLM_FRACTION = 0.5  # colocated vLLM fraction below this leaves a small KV cache
CPU_BOUND_PCT_PER_GPU = 200.0  # host CPU of the tree, in % of one core per GPU, above this: CPU-bound
# Share of measured samples below --min-util from which a trial is diagnosed whatever its mean: a busy
# step dips only for the weight sync and optimizer step, offload swings idle about half the time.
IDLE_SHARE_LIMIT = 0.3
# ms-swift's own knobs for moving the model and optimizer around generation (swift rlhf flags)
SWIFT_KNOBS = ("offload_model", "offload_optimizer", "move_model_batches", "sleep_level")


def number(text: str | None) -> float | None:
    """A finite number from a CSV or log field, else None (blank, unreadable, NaN, infinite)."""
    if text is None or text.strip() == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _float(value: Any) -> float | None:
    """A finite number from a parameter or metrics value of any type, else None."""
    if isinstance(value, str):
        return number(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) else None
    return None


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def diagnose_low_util(
    mean_util: float | None,
    params: Mapping[str, Any] | None,
    min_util: float = 0.5,
    step_times: Mapping[str, float] | None = None,
    *,
    host_cpu_pct: float | None = None,
    gpus: int = 1,
    idle_share: float | None = None,
) -> str | None:
    """One line saying why the GPUs were idle, or None when utilization is fine (or unknown).

    ``mean_util``, ``min_util`` and ``idle_share`` (the share of measured samples below
    ``min_util``) are fractions. Diagnosed: a mean below ``min_util``, *or* :data:`IDLE_SHARE_LIMIT`
    or more of the time below it (a 0%..90% swing averages 50% and idles half of the time). The
    line starts with the mean and the share of time below, so a swing reads as one.
    ``step_times`` may carry ``generation_time`` and ``training_time`` (sums or means over the
    measured steps: only their ratio is used), as the worker and the simulator write them to the
    metrics file (see :func:`phase_times`). ``host_cpu_pct`` is the mean CPU of the trial's process
    tree, 100 = one core.

    The rule, first match wins; measured evidence comes before what the parameters suggest:

    1. **Generation-bound**: generation is at least 60% of the step. Decoding is memory-bound and
       runs at low occupancy when few sequences decode together, so: with a colocated vLLM fraction
       under 0.5 the KV cache is the likely limit (raise ``vllm_gpu_memory_utilization``); without
       vLLM, transformers' generate is the limit (``use_vllm``); otherwise more sequences per
       generation batch or tensor parallelism.
    2. **Offload**: ``offload`` is not ``none``, or ms-swift's ``offload_model`` /
       ``offload_optimizer`` are on. DeepSpeed then moves gradients and optimizer state (and with
       ``optimizer+params`` the weights, every forward and backward) over PCIe and runs Adam on the
       CPU, while the GPUs wait; ms-swift's offloads move the model and optimizer to the CPU for
       every generation and back. When the trial's parameters hold ms-swift's knobs
       (:data:`SWIFT_KNOBS`), the advice names them (and ``move_model_batches``, ``sleep_level``)
       as ``swift rlhf`` takes them, instead of TRL's names.
    3. **Sleep wake-ups**: vLLM sleep mode (TRL's ``vllm_enable_sleep_mode``, ms-swift's
       ``sleep_level`` 1 or 2) frees the engine's memory for training and re-allocates it at every
       generation, or ms-swift's ``move_model_batches`` splits the weight sync into many small
       copies; the GPUs idle through both.
    4. **CPU-bound**: the tree's CPU is at least two cores per GPU. One busy core per rank proves
       nothing: a process waiting on CUDA spin-waits at ~100% (so does vLLM's engine loop), busy
       GPU or not. Sustained work beyond that core is real host computation that the step waits
       for: DataLoader workers, tokenization, a CPU-side reward, CPU ops.
    5. **Communication**: ZeRO-3 on two or more GPUs all-gathers the weights for every forward and
       backward and reduce-scatters the gradients; with small per-GPU batches the GPUs wait on that.
    6. Otherwise a generic line pointing at the batch size and the trial's files.
    """
    if mean_util is None:
        return None
    swings = idle_share is not None and idle_share >= IDLE_SHARE_LIMIT
    if mean_util >= min_util and not swings:
        return None
    p = dict(params or {})
    head = _head(mean_util, min_util, idle_share)
    cpu_note = f", host CPU {host_cpu_pct:.0f}% of a core" if host_cpu_pct is not None else ""
    return (
        _generation_line(p, head, step_times)
        or _swift_line(p, head, cpu_note)
        or _offload_or_sleep_line(p, head, cpu_note)
        or _host_or_communication_line(p, head, host_cpu_pct, gpus)
    )


def _head(mean_util: float, min_util: float, idle_share: float | None) -> str:
    """The line's start: the mean and the share of time below ``min_util``, so a swing reads as one."""
    if mean_util < min_util:
        head = f"GPU utilization {mean_util:.0%} < {min_util:.0%}"
        if idle_share is not None:
            head += f" (below it {idle_share:.0%} of the time)"
        return head
    return f"GPU utilization below {min_util:.0%} for {idle_share:.0%} of the time (mean {mean_util:.0%})"


def _generation_line(p: dict[str, Any], head: str, step_times: Mapping[str, float] | None) -> str | None:
    """Rule 1: generation takes most of the step (measured evidence, so it comes first)."""
    times = step_times or {}
    gen, train = _float(times.get("generation_time")), _float(times.get("training_time"))
    gen_share = gen / (gen + train) if gen is not None and train is not None and gen + train > 0 else None
    if gen_share is not None and gen_share >= GENERATION_BOUND_SHARE:
        fraction = _float(p.get("vllm_gpu_memory_utilization"))
        uses_vllm = _truthy(p["use_vllm"]) if "use_vllm" in p else fraction is not None
        share = f"generation takes {gen_share:.0%} of each step"
        if uses_vllm and fraction is not None and fraction < SMALL_VLLM_FRACTION:
            return (
                f"{head}: {share} and the vLLM cache is small (vllm_gpu_memory_utilization={fraction:g}): "
                "raise vllm_gpu_memory_utilization so more sequences decode at once"
            )
        if not uses_vllm:
            return f"{head}: {share} with transformers' generate: enable use_vllm"
        return (
            f"{head}: {share}: decode more sequences together (larger per_device_train_batch_size) "
            "or raise vllm_tensor_parallel_size"
        )
    return None


def _offload_or_sleep_line(p: dict[str, Any], head: str, cpu_note: str) -> str | None:
    """Rules 2 and 3 in TRL's and DeepSpeed's words: offload over PCIe, vLLM sleep wake-ups."""
    offload = str(p.get("offload", "none") or "none")
    if offload != "none":
        if "params" in offload:
            return (
                f"{head}: offload={offload} moves the weights over PCIe every forward and backward"
                f"{cpu_note}: try offload=optimizer, or zero_stage 3 without offload"
            )
        return (
            f"{head}: offload={offload} moves gradients and optimizer state over PCIe and runs Adam on "
            f"the CPU{cpu_note}: try zero_stage 3 without offload, or a smaller offload"
        )
    if _truthy(p.get("vllm_enable_sleep_mode", False)) and _truthy(p.get("use_vllm", True)):
        return (
            f"{head}: vllm_enable_sleep_mode frees vLLM's memory for training and re-allocates it for "
            "every generation, and the GPUs idle through each wake-up: try vllm_enable_sleep_mode=false "
            "if memory allows"
        )
    return None


def _host_or_communication_line(p: dict[str, Any], head: str, host_cpu_pct: float | None, gpus: int) -> str:
    """Rules 4 to 6: a busy host CPU, ZeRO-3's gathers across GPUs, else a pointer to the files."""
    if host_cpu_pct is not None and host_cpu_pct >= CPU_BOUND_PCT_PER_GPU * max(gpus, 1):
        return (
            f"{head}: the host CPU is busy ({host_cpu_pct / max(gpus, 1):.0f}% of a core per GPU) while the "
            "GPUs idle: data loading, tokenization or a CPU-side reward bounds the step "
            "(raise dataloader_num_workers, make the reward cheaper)"
        )
    stage = _float(p.get("zero_stage"))
    if stage == 3 and gpus >= 2:
        return (
            f"{head}: ZeRO-3 gathers the weights across {gpus} GPUs every forward and backward, so the GPUs "
            "wait on communication: try zero_stage 2 if memory allows, or a larger "
            "per_device_train_batch_size"
        )
    batch = p.get("per_device_train_batch_size")
    return (
        f"{head}: no cause stands out in the parameters or step times"
        + (f"; per_device_train_batch_size={batch} may be too small to fill the GPU" if batch else "")
        + f"; see {GPU_CSV} and {STDOUT}"
    )


def _swift_line(p: Mapping[str, Any], head: str, cpu_note: str) -> str | None:
    """The offload / sleep diagnosis in ms-swift's words, when the trial's parameters hold its knobs.

    Write-up 004 (Qwen2.5-VL-3B, GRPO, 2 GPUs, ``--deepspeed zero3_offload``, ``offload_model``,
    ``offload_optimizer``, ``move_model_batches 16``, ``sleep_level 1``): utilization swung between
    0% and 90%; turning these off and using ``zero3`` halved the training time. Each knob that is on
    is named with what it costs and the ``swift rlhf`` setting that turns it off.
    """
    if not any(k in p for k in SWIFT_KNOBS):
        return None
    causes: list[str] = []
    fixes: list[str] = []
    offload = str(p.get("offload", "none") or "none")
    if offload != "none":
        causes.append(f"DeepSpeed offload ({offload}) moves states over PCIe and runs Adam on the CPU")
        fixes.append(
            "--deepspeed zero3 instead of zero3_offload (offload=none)"
            if "params" in offload
            else "--deepspeed zero2 or zero3 without offload (offload=none)"
        )
    moved = {
        k: what
        for k, what in (("offload_model", "weights"), ("offload_optimizer", "optimizer state"))
        if _truthy(p.get(k, False))
    }
    if moved:
        causes.append(
            f"{' and '.join(moved)} move{'s' if len(moved) == 1 else ''} the "
            f"{' and '.join(moved.values())} to the CPU for every generation and back"
        )
        fixes += [f"--{k} false" for k in moved]
    level = _float(p.get("sleep_level"))
    if level is not None and level > 0:
        causes.append(
            f"sleep_level {level:g} frees vLLM's memory while training and wakes the engine for every "
            "generation"
        )
        fixes.append("--sleep_level 0")
    batches = _float(p.get("move_model_batches"))
    if batches is not None and batches > 1:
        causes.append(f"move_model_batches {batches:g} splits every weight sync into {batches:g} copies")
        fixes.append("no --move_model_batches")
    if not causes:
        return None
    return f"{head}: {'; '.join(causes)}{cpu_note}: try {', '.join(fixes)} if memory allows"
