"""A trial's samples (ticks) and what they say: peaks, the measured-steps utilization, and why it was low.

The trainer's own metrics say how fast a trial went and how much memory *PyTorch* reserved; they do
not say whether the GPUs were busy. :class:`MonitorSummary` is what goes into ``outcome.json``: peak
memory per GPU, peak host RSS, mean utilization over the *measured* steps only (start-up, model
loading and warm-up would drag it down and say nothing about the configuration), and a ``low_util``
flag with a one-line :func:`diagnose_low_util` reason. :func:`summarize` is the same reduction for
live samples (:class:`~autotune.trial.telemetry.GpuSampler`) and recorded ones; :func:`read_ticks`
and :func:`summarize_file` read a gpu.csv back (one a trial wrote itself, as the simulator does).

Low utilization is judged on the time spent below ``--min-util``, not only on the mean: ZeRO-3 with
offload swings between 0% and 90% (write-up 004) and averages ~50%, which a mean-only rule passes
while the GPUs wait half of the time. ``idle_share`` is the fraction of the measured samples (over
every watched GPU) below ``min_util``; at :data:`IDLE_SHARE_LIMIT` or more the trial is diagnosed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autotune.trial.layout import GPU_CSV, STDOUT
from autotune.trial.metrics import PLAUSIBLE_STEP_S, to_float

__all__ = [
    "GpuReading",
    "Tick",
    "MEASURE",
    "MonitorSummary",
    "summarize",
    "diagnose_low_util",
    "phase_times",
    "read_ticks",
    "summarize_file",
    "idle_share",
    "GENERATION_BOUND_SHARE",
    "SMALL_VLLM_FRACTION",
    "CPU_BOUND_PCT_PER_GPU",
    "IDLE_SHARE_LIMIT",
    "SWIFT_KNOBS",
]

MEASURE = "measure"  # the phase label of the steps whose utilization counts (GpuSampler.mark)

# Thresholds of the low-utilization diagnosis (see diagnose_low_util for why these values).
GENERATION_BOUND_SHARE = 0.6  # generation time / (generation + training) above this: generation-bound
SMALL_VLLM_FRACTION = 0.5  # colocated vLLM fraction below this leaves a small KV cache
CPU_BOUND_PCT_PER_GPU = 200.0  # host CPU of the tree, in % of one core per GPU, above this: CPU-bound
# Share of measured samples below --min-util from which a trial is diagnosed whatever its mean: a busy
# step dips only for the weight sync and optimizer step, offload swings idle about half the time.
IDLE_SHARE_LIMIT = 0.3
# ms-swift's own knobs for moving the model and optimizer around generation (swift rlhf flags)
SWIFT_KNOBS = ("offload_model", "offload_optimizer", "move_model_batches", "sleep_level")


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
    host_cpu_pct: float | None = None  # summed over the tree: 100 = one core busy, as in top

    def rows(self) -> list[list[str]]:
        """The gpu.csv rows of this tick: one per GPU (host values repeated), or one without GPUs."""
        host = [_fmt(self.host_rss_gib, 3), _fmt(self.host_cpu_pct, 1)]
        head = [f"{self.time_s:.3f}", self.phase]
        if not self.gpus:
            return [head + ["", "", "", ""] + host]
        return [
            head + [str(g.gpu), _fmt(g.util_pct, 0), _fmt(g.mem_used_gib, 3), _fmt(g.mem_total_gib, 3)] + host
            for g in self.gpus
        ]


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
    gpus: list[int] = field(default_factory=list)  # NVML index of each peak_memory_gib_per_gpu entry
    mean_gpu_util_per_gpu: list[float | None] = field(default_factory=list)
    mean_host_cpu_pct: float | None = None
    nvml: bool = False
    peak_process_rss_gib: float | None = None  # the largest one process's peak RSS (kernel's VmHWM)
    idle_share: float | None = None  # fraction of the measured GPU samples below min_util
    min_util: float | None = None  # the threshold idle_share and low_util were judged against

    @property
    def peak_memory_gib(self) -> float | None:
        """The largest device memory use over the trial's GPUs (docs/trial-contract.md's peak_memory_gib)."""
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


def summarize(
    ticks: Sequence[Tick],
    *,
    params: Mapping[str, Any] | None = None,
    min_util: float = 0.5,
    step_times: Mapping[str, float] | None = None,
    gpu_indices: Sequence[int] | None = None,
    nvml: bool | None = None,
    peak_process_rss_gib: float | None = None,
) -> MonitorSummary:
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
    below = idle_share(every_util, min_util)

    rss = [t.host_rss_gib for t in ticks if t.host_rss_gib is not None]
    cpu = [t.host_cpu_pct for t in measured if t.host_cpu_pct is not None]
    mean_cpu = sum(cpu) / len(cpu) if cpu else None

    watched = [i for i in order if i in peaks or i in utils]
    diagnosis = diagnose_low_util(
        mean_util,
        params,
        min_util,
        step_times,
        host_cpu_pct=mean_cpu,
        gpus=max(len(watched), 1),
        idle_share=below,
    )
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
        idle_share=below,
        min_util=min_util,
    )


def idle_share(utils: Sequence[float], min_util: float) -> float | None:
    """The fraction of utilization samples (fractions, 0.9 = 90%) below ``min_util``; None without any."""
    if not utils:
        return None
    return sum(1 for u in utils if u < min_util) / len(utils)


def read_ticks(path: Path) -> list[Tick]:
    """A gpu.csv (the columns of :data:`autotune.trial.telemetry.CSV_COLUMNS`) read back into ticks.

    Rows of one tick share ``time_s`` and ``phase``. Empty cells are None; a torn last line or a
    row that is not numbers (a trainer may die mid-write) is skipped rather than trusted. Missing or
    unreadable file: no ticks.
    """
    ticks: list[Tick] = []
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            for row in csv.DictReader(fh):
                t = _num(row.get("time_s"))
                if t is None or None in row.values():  # a short row: DictReader fills it with None
                    continue
                phase = (row.get("phase") or "").strip()
                if not ticks or ticks[-1].time_s != t or ticks[-1].phase != phase:
                    ticks.append(
                        Tick(
                            t,
                            phase,
                            host_rss_gib=_num(row.get("host_rss_gib")),
                            host_cpu_pct=_num(row.get("host_cpu_pct")),
                        )
                    )
                gpu = _num(row.get("gpu"))
                if gpu is not None:
                    ticks[-1].gpus.append(
                        GpuReading(
                            int(gpu),
                            _num(row.get("util_pct")),
                            _num(row.get("mem_used_gib")),
                            _num(row.get("mem_total_gib")),
                        )
                    )
    except OSError:
        return []
    return ticks


def summarize_file(
    path: Path,
    *,
    params: Mapping[str, Any] | None = None,
    min_util: float = 0.5,
    step_times: Mapping[str, float] | None = None,
) -> MonitorSummary | None:
    """The :class:`MonitorSummary` of a gpu.csv the trial wrote itself, or None when it wrote none.

    For trials autotune does not sample (the simulator writes its own gpu.csv, following its
    physics): the controller folds this into the outcome exactly as it does a live sampler's.
    """
    ticks = read_ticks(path)
    if not ticks:
        return None
    return summarize(ticks, params=params, min_util=min_util, step_times=step_times)


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
    if mean_util < min_util:
        head = f"GPU utilization {mean_util:.0%} < {min_util:.0%}"
        if idle_share is not None:
            head += f" (below it {idle_share:.0%} of the time)"
    else:
        head = f"GPU utilization below {min_util:.0%} for {idle_share:.0%} of the time (mean {mean_util:.0%})"

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

    cpu_note = f", host CPU {host_cpu_pct:.0f}% of a core" if host_cpu_pct is not None else ""
    swift = _swift_line(p, head, cpu_note)
    if swift is not None:
        return swift
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


def phase_times(metrics_file: Path, after_step: int = 0) -> dict[str, float] | None:
    """Sum ``generation_time``, ``training_time`` and ``step_time`` over the steps after warm-up.

    Reads the optional fields our worker and the simulator add to the metrics lines; other
    trainers do not write them, and then there is nothing to return (None).
    """
    try:
        text = metrics_file.read_text(encoding="utf-8", errors="replace")  # a trainer may write any byte
    except OSError:
        return None
    sums: dict[str, float] = {}
    steps = 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("step"), (int, float))
            or rec["step"] <= after_step
        ):
            continue
        seen = False
        for key in ("generation_time", "training_time", "step_time"):
            value = to_float(rec.get(key))  # finite, or None (a 400-digit integer overflows float)
            if value is not None and 0 <= value < PLAUSIBLE_STEP_S:
                sums[key] = sums.get(key, 0.0) + value
                seen = True
        steps += seen
    if "generation_time" not in sums or "training_time" not in sums:
        return None
    sums["steps"] = float(steps)
    return sums
