"""A trial's samples (ticks) and what they say: peaks, the measured-steps utilization, and why it was low.

The trainer's own metrics say how fast a trial went and how much memory *PyTorch* reserved; they do
not say whether the GPUs were busy. :class:`MonitorSummary` is what goes into ``outcome.json``: peak
memory per GPU, peak host RSS, mean utilization over the *measured* steps only (start-up, model
loading and warm-up would drag it down and say nothing about the configuration), and a ``low_util``
flag with a one-line reason (:mod:`autotune.trial.diagnosis`). :func:`summarize` is the same reduction for
live samples (:class:`~autotune.trial.telemetry.GpuSampler`) and recorded ones; :func:`read_ticks`
and :func:`summarize_file` read a gpu.csv back (one a trial wrote itself, as the simulator does).

Low utilization is judged on the time spent below ``--min-util``, not only on the mean: ZeRO-3 with
offload swings between 0% and 90% (write-up 004) and averages ~50%, which a mean-only rule passes
while the GPUs wait half of the time. ``idle_share`` is the fraction of the measured samples (over
every watched GPU) below ``min_util``; at ``IDLE_SHARE_LIMIT`` or more the trial is diagnosed.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autotune.trial.diagnosis import diagnose_low_util, number
from autotune.trial.metrics import PLAUSIBLE_STEP_S, to_float

__all__ = [
    "GpuReading",
    "Tick",
    "MEASURE",
    "MonitorSummary",
    "summarize",
    "phase_times",
    "read_ticks",
    "summarize_file",
    "idle_share",
]

MEASURE = "measure"  # the phase label of the steps whose utilization counts (GpuSampler.mark)


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

    Rows of one tick share ``time_s`` and ``phase``, one row a GPU; a GPU seen again starts the next
    tick even at the same millisecond (ticks driven fast, or a clock step). Empty cells are None; a
    torn last line or a row that is not numbers (a trainer may die mid-write) is skipped rather than
    trusted. Missing or unreadable file: no ticks.
    """
    ticks: list[Tick] = []
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            for row in csv.DictReader(fh):
                t = number(row.get("time_s"))
                if t is None or None in row.values():  # a short row: DictReader fills it with None
                    continue
                phase = (row.get("phase") or "").strip()
                gpu = number(row.get("gpu"))
                seen = gpu is not None and bool(ticks) and any(r.gpu == int(gpu) for r in ticks[-1].gpus)
                if not ticks or ticks[-1].time_s != t or ticks[-1].phase != phase or seen:
                    ticks.append(
                        Tick(
                            t,
                            phase,
                            host_rss_gib=number(row.get("host_rss_gib")),
                            host_cpu_pct=number(row.get("host_cpu_pct")),
                        )
                    )
                if gpu is not None:
                    ticks[-1].gpus.append(
                        GpuReading(
                            int(gpu),
                            number(row.get("util_pct")),
                            number(row.get("mem_used_gib")),
                            number(row.get("mem_total_gib")),
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
