"""A trial's samples (ticks) and what they say: peaks, the measured-steps utilization, and why it was low.

The trainer's own metrics say how fast a trial went and how much memory *PyTorch* reserved; they do
not say whether the GPUs were busy. :class:`MonitorSummary` is what goes into ``outcome.json``: peak
memory per GPU, peak host RSS, mean utilization over the *measured* steps only (start-up, model
loading and warm-up would drag it down and say nothing about the configuration), and a ``low_util``
flag with a one-line :func:`diagnose_low_util` reason. :func:`summarize` is the same reduction for
live samples (:class:`~autotune.trial.telemetry.GpuSampler`) and recorded ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from autotune.trial.metrics import PLAUSIBLE_STEP_S, to_float

__all__ = [
    "GpuReading", "Tick", "MEASURE", "MonitorSummary", "summarize", "diagnose_low_util", "phase_times",
    "GENERATION_BOUND_SHARE", "SMALL_VLLM_FRACTION", "CPU_BOUND_PCT_PER_GPU",
]

MEASURE = "measure"   # the phase label of the steps whose utilization counts (GpuSampler.mark)

# Thresholds of the low-utilization diagnosis (see diagnose_low_util for why these values).
GENERATION_BOUND_SHARE = 0.6   # generation time / (generation + training) above this: generation-bound
SMALL_VLLM_FRACTION = 0.5      # colocated vLLM fraction below this leaves a small KV cache
CPU_BOUND_PCT_PER_GPU = 200.0  # host CPU of the tree, in % of one core per GPU, above this: CPU-bound


@dataclass
class GpuReading:
    """One GPU at one tick. ``util_pct`` is None where the device does not report it (MIG)."""

    gpu: int
    util_pct: float | None
    mem_used_gib: float | None
    mem_total_gib: float | None


@dataclass
class Tick:
    """Everything sampled at one moment: the GPUs and the trial's process tree on the host."""

    time_s: float
    phase: str
    gpus: list[GpuReading] = field(default_factory=list)
    host_rss_gib: float | None = None
    host_cpu_pct: float | None = None   # summed over the tree: 100 = one core busy, as in top

    def rows(self) -> list[list[str]]:
        """The gpu.csv rows of this tick: one per GPU (host values repeated), or one without GPUs."""
        host = [_fmt(self.host_rss_gib, 3), _fmt(self.host_cpu_pct, 1)]
        head = [f"{self.time_s:.3f}", self.phase]
        if not self.gpus:
            return [head + ["", "", "", ""] + host]
        return [head + [str(g.gpu), _fmt(g.util_pct, 0), _fmt(g.mem_used_gib, 3),
                        _fmt(g.mem_total_gib, 3)] + host for g in self.gpus]


def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _num(text: str | None) -> float | None:
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
        return _num(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) else None
    return None


@dataclass
class MonitorSummary:
    """What one trial's sampling found, for outcome.json.

    ``mean_gpu_util`` is a fraction (0.9 = 90%), comparable with ``--min-util``; gpu.csv keeps the
    percent NVML reports. Peaks are over the whole trial (memory peaks at any phase), the mean over
    the ticks marked ``measure`` (all ticks when nothing was marked).
    """

    peak_memory_gib_per_gpu: list[float]
    peak_host_rss_gib: float | None
    mean_gpu_util: float | None
    low_util: bool
    diagnosis: str | None
    samples: int
    gpus: list[int] = field(default_factory=list)   # NVML index of each peak_memory_gib_per_gpu entry
    mean_gpu_util_per_gpu: list[float | None] = field(default_factory=list)
    mean_host_cpu_pct: float | None = None
    nvml: bool = False
    peak_process_rss_gib: float | None = None   # the largest one process's peak RSS (kernel's VmHWM)

    @property
    def peak_memory_gib(self) -> float | None:
        """The largest device memory use over the trial's GPUs (DESIGN.md's peak_memory_gib)."""
        return max(self.peak_memory_gib_per_gpu) if self.peak_memory_gib_per_gpu else None

    @property
    def peak_host_gib(self) -> float | None:
        """The trial process tree's peak RSS: the largest sampled sum over the tree, or one
        process's own peak when a spike between two samples went higher."""
        known = [v for v in (self.peak_host_rss_gib, self.peak_process_rss_gib) if v is not None]
        return max(known) if known else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (rounded, so outcome.json stays readable)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 4)
            elif isinstance(value, list):
                out[key] = [round(v, 4) if isinstance(v, float) else v for v in value]
        return out


def summarize(ticks: Sequence[Tick], *, params: Mapping[str, Any] | None = None, min_util: float = 0.5,
              step_times: Mapping[str, float] | None = None, gpu_indices: Sequence[int] | None = None,
              nvml: bool | None = None, peak_process_rss_gib: float | None = None) -> MonitorSummary:
    """Reduce samples to a :class:`MonitorSummary` (the same code for live and recorded samples).

    ``gpu_indices`` fixes the order of the per-GPU lists (by default the order GPUs first appear).
    ``nvml`` says whether GPU sampling was on; by default, whether any GPU reading exists.
    """
    order: list[int] = list(gpu_indices or [])
    for tick in ticks:
        for g in tick.gpus:
            if g.gpu not in order:
                order.append(g.gpu)
    measured = [t for t in ticks if t.phase == MEASURE] or list(ticks)

    peaks: dict[int, float] = {}
    for tick in ticks:
        for g in tick.gpus:
            if g.mem_used_gib is not None:
                peaks[g.gpu] = max(peaks.get(g.gpu, 0.0), g.mem_used_gib)
    utils: dict[int, list[float]] = {}
    for tick in measured:
        for g in tick.gpus:
            if g.util_pct is not None:
                utils.setdefault(g.gpu, []).append(g.util_pct / 100.0)
    every_util = [u for values in utils.values() for u in values]
    mean_util = sum(every_util) / len(every_util) if every_util else None

    rss = [t.host_rss_gib for t in ticks if t.host_rss_gib is not None]
    cpu = [t.host_cpu_pct for t in measured if t.host_cpu_pct is not None]
    mean_cpu = sum(cpu) / len(cpu) if cpu else None

    watched = [i for i in order if i in peaks or i in utils]
    diagnosis = diagnose_low_util(mean_util, params, min_util, step_times, host_cpu_pct=mean_cpu,
                                  gpus=max(len(watched), 1))
    return MonitorSummary(
        peak_memory_gib_per_gpu=[peaks.get(i, 0.0) for i in watched],
        peak_host_rss_gib=max(rss) if rss else None,
        mean_gpu_util=mean_util,
        low_util=diagnosis is not None,
        diagnosis=diagnosis,
        samples=len(ticks),
        gpus=watched,
        mean_gpu_util_per_gpu=[(sum(utils[i]) / len(utils[i])) if utils.get(i) else None for i in watched],
        mean_host_cpu_pct=mean_cpu,
        nvml=bool(watched) if nvml is None else nvml,
        peak_process_rss_gib=peak_process_rss_gib,
    )


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def diagnose_low_util(mean_util: float | None, params: Mapping[str, Any] | None, min_util: float = 0.5,
                      step_times: Mapping[str, float] | None = None, *, host_cpu_pct: float | None = None,
                      gpus: int = 1) -> str | None:
    """One line saying why the GPUs were idle, or None when utilization is fine (or unknown).

    ``mean_util`` and ``min_util`` are fractions. ``step_times`` may carry ``generation_time`` and
    ``training_time`` (sums or means over the measured steps: only their ratio is used), as the
    worker and the simulator write them to the metrics file (see :func:`phase_times`).
    ``host_cpu_pct`` is the mean CPU of the trial's process tree, 100 = one core.

    The rule, first match wins; measured evidence comes before what the parameters suggest:

    1. **Generation-bound**: generation is at least 60% of the step. Decoding is memory-bound and
       runs at low occupancy when few sequences decode together, so: with a colocated vLLM fraction
       under 0.5 the KV cache is the likely limit (raise ``vllm_gpu_memory_utilization``); without
       vLLM, transformers' generate is the limit (``use_vllm``); otherwise more sequences per
       generation batch or tensor parallelism.
    2. **Offload**: ``offload`` is not ``none``. DeepSpeed then moves gradients and optimizer state
       (and with ``optimizer+params`` the weights, every forward and backward) over PCIe and runs
       Adam on the CPU, while the GPUs wait.
    3. **CPU-bound**: the tree's CPU is at least two cores per GPU. One busy core per rank proves
       nothing: a process waiting on CUDA spin-waits at ~100% (so does vLLM's engine loop), busy
       GPU or not. Sustained work beyond that core is real host computation that the step waits
       for: DataLoader workers, tokenization, a CPU-side reward, CPU ops.
    4. **Communication**: ZeRO-3 on two or more GPUs all-gathers the weights for every forward and
       backward and reduce-scatters the gradients; with small per-GPU batches the GPUs wait on that.
    5. Otherwise a generic line pointing at the batch size and the trial's files.
    """
    if mean_util is None or mean_util >= min_util:
        return None
    p = dict(params or {})
    head = f"GPU utilization {mean_util:.0%} < {min_util:.0%}"

    times = step_times or {}
    gen, train = _float(times.get("generation_time")), _float(times.get("training_time"))
    gen_share = gen / (gen + train) if gen is not None and train is not None and gen + train > 0 else None
    if gen_share is not None and gen_share >= GENERATION_BOUND_SHARE:
        fraction = _float(p.get("vllm_gpu_memory_utilization"))
        uses_vllm = _truthy(p["use_vllm"]) if "use_vllm" in p else fraction is not None
        share = f"generation takes {gen_share:.0%} of each step"
        if uses_vllm and fraction is not None and fraction < SMALL_VLLM_FRACTION:
            return (f"{head}: {share} and the vLLM cache is small (vllm_gpu_memory_utilization={fraction:g}): "
                    "raise vllm_gpu_memory_utilization so more sequences decode at once")
        if not uses_vllm:
            return f"{head}: {share} with transformers' generate: enable use_vllm"
        return (f"{head}: {share}: decode more sequences together (larger per_device_train_batch_size) "
                "or raise vllm_tensor_parallel_size")

    cpu_note = f", host CPU {host_cpu_pct:.0f}% of a core" if host_cpu_pct is not None else ""
    offload = str(p.get("offload", "none") or "none")
    if offload != "none":
        if "params" in offload:
            return (f"{head}: offload={offload} moves the weights over PCIe every forward and backward"
                    f"{cpu_note}: try offload=optimizer, or zero_stage 3 without offload")
        return (f"{head}: offload={offload} moves gradients and optimizer state over PCIe and runs Adam on "
                f"the CPU{cpu_note}: try zero_stage 3 without offload, or a smaller offload")

    if host_cpu_pct is not None and host_cpu_pct >= CPU_BOUND_PCT_PER_GPU * max(gpus, 1):
        return (f"{head}: the host CPU is busy ({host_cpu_pct / max(gpus, 1):.0f}% of a core per GPU) while the "
                "GPUs idle: data loading, tokenization or a CPU-side reward bounds the step "
                "(raise dataloader_num_workers, make the reward cheaper)")

    stage = _float(p.get("zero_stage"))
    if stage == 3 and gpus >= 2:
        return (f"{head}: ZeRO-3 gathers the weights across {gpus} GPUs every forward and backward, so the GPUs "
                "wait on communication: try zero_stage 2 if memory allows, or a larger "
                "per_device_train_batch_size")

    batch = p.get("per_device_train_batch_size")
    return (f"{head}: no cause stands out in the parameters or step times"
            + (f"; per_device_train_batch_size={batch} may be too small to fill the GPU" if batch else "")
            + "; see gpu.csv and stdout.log")


def phase_times(metrics_file: Path, after_step: int = 0) -> dict[str, float] | None:
    """Sum ``generation_time``, ``training_time`` and ``step_time`` over the steps after warm-up.

    Reads the optional fields our worker and the simulator add to the metrics lines; other
    trainers do not write them, and then there is nothing to return (None).
    """
    try:
        text = metrics_file.read_text(encoding="utf-8", errors="replace")   # a trainer may write any byte
    except OSError:
        return None
    sums: dict[str, float] = {}
    steps = 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)) or rec["step"] <= after_step:
            continue
        seen = False
        for key in ("generation_time", "training_time", "step_time"):
            value = to_float(rec.get(key))   # finite, or None (a 400-digit integer overflows float)
            if value is not None and 0 <= value < PLAUSIBLE_STEP_S:
                sums[key] = sums.get(key, 0.0) + value
                seen = True
        steps += seen
    if "generation_time" not in sums or "training_time" not in sums:
        return None
    sums["steps"] = float(steps)
    return sums
