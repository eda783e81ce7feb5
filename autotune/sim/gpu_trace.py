"""The simulated trial's gpu.csv: GPU utilization and memory over time, following the landscape.

Why: autotune diagnoses low GPU utilization from gpu.csv (:mod:`autotune.trial.utilization`); a
rehearsal with the simulator must be able to show that diagnosis, so the simulated trainer writes
the samples NVML would have given, in the same file and columns the real sampler writes
(:data:`autotune.trial.telemetry.CSV_COLUMNS`, rows rendered by :meth:`Tick.rows`).

What the samples follow (the landscape's own time split of each step, ``TrialTruth.info``):
generation waves (vLLM decode keeps the GPUs busy, more so with more sequences in flight;
transformers' generate much less), the weight sync into the engine and, with sleep mode, its
wake-up (the GPUs wait), the micro-batches (kernels; ZeRO-3 hooks and exposed communication;
offload's PCIe transfers, during which the GPUs idle) and the optimizer step (on the GPU, or
DeepSpeed's CPU Adam with offload, when the GPUs idle and the host's cores are busy). A sample is
the mean level over the interval before it, as NVML's counter is, plus a little noise.

Times are simulated seconds since the trial started (the clock of its ``step_time``), so a
timeline reads as the real run's would. Phases: ``start`` (start-up), ``warmup`` (the first
``warmup_steps`` steps, spec key, default 2, the landscape's slow steps), ``measure`` after that.
Only what happened is written: a step once it completed, a failed start-up up to its failure, and
the step a trial died in up to the failure (a CUDA OOM fills the GPU to its capacity there).
"""

from __future__ import annotations

import bisect
import csv
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from autotune.sim.landscape import Scenario, TrialTruth
from autotune.trial.telemetry import CSV_COLUMNS, CSV_NAME
from autotune.trial.utilization import MEASURE, GpuReading, Tick

# utilization levels (percent of the sample period with a kernel running) of each kind of work
LEVEL = {
    "start": 3.0,
    "generate_vllm": 93.0,
    "generate_vllm_few": 62.0,
    "generate_hf": 34.0,
    "sync": 22.0,
    "wake": 4.0,
    "compute": 96.0,
    "hooks": 28.0,
    "comm": 55.0,
    "pcie": 6.0,
    "optimizer_gpu": 88.0,
    "optimizer_cpu": 2.0,
    "misc": 30.0,
    "server_wait": 4.0,
}
FEW_SEQUENCES = 32  # vLLM decoding fewer sequences at once than this runs at lower occupancy
SUBSAMPLES = 8  # points averaged per sample (NVML reports the busy share of its period)


class GpuTrace:
    """Appends the samples of the start-up and of each completed step to ``trial_dir/gpu.csv``."""

    def __init__(self, trial_dir: Path, truth: TrialTruth, sc: Scenario, spec: dict[str, Any]) -> None:
        self.truth, self.sc = truth, sc
        self.k = sc.k
        self.info = truth.info
        self.warmup = int(spec.get("warmup_steps", 2) or 0)
        self.rng = random.Random(f"{sc.seed}-gpu")
        steady = truth.steady_step_time() or 30.0
        self.interval = min(max(steady / 40.0, 0.25), 5.0)
        self.server_gpus = self.k.tp * self.k.vllm_dp if self.k.server else 0
        self.gpus = max(sc.gpus, 1)
        self.segments: list[tuple[float, float, str]] = []  # (start, end, level name), in order
        self.starts: list[float] = []
        self.now = 0.0  # simulated seconds written up to
        self.next_sample = 0.0
        trial_dir.mkdir(parents=True, exist_ok=True)
        self.fh: TextIO = open(trial_dir / CSV_NAME, "w", newline="", encoding="utf-8")
        self.writer = csv.writer(self.fh)
        self.writer.writerow(CSV_COLUMNS)
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()

    # -- timeline ------------------------------------------------------------------------------
    def _add(self, seconds: float, level: str) -> None:
        if seconds <= 0:
            return
        start = self.segments[-1][1] if self.segments else 0.0
        self.segments.append((start, start + seconds, level))
        self.starts.append(start)

    def _level_at(self, t: float) -> str:
        i = max(bisect.bisect_right(self.starts, t) - 1, 0)
        return self.segments[i][2] if self.segments else "start"

    def _util(self, t: float, levels: dict[str, float]) -> float:
        """Mean level over the interval before ``t`` (NVML's counter), with a little noise."""
        width = self.interval / SUBSAMPLES
        mean = sum(levels[self._level_at(max(t - i * width, 0.0))] for i in range(SUBSAMPLES)) / SUBSAMPLES
        return min(max(mean + self.rng.gauss(0.0, 2.5), 0.0), 100.0)

    # -- what is written -----------------------------------------------------------------------
    def startup(self) -> None:
        """Model load, DeepSpeed, the vLLM engine: low utilization while memory fills up."""
        self._add(self.truth.startup_s, "start")
        peak = self.truth.startup_peak_gib
        host = float(self.info.get("host_init_gib", 4.0))
        low = min(0.5, peak)  # the CUDA context first, then the weights, DeepSpeed's states, vLLM
        self._flush(
            "start", lambda t: low + (peak - low) * min(t / max(self.truth.startup_s, 1e-9), 1.0), host
        )

    def step(self, number: int, gen_s: float, train_s: float, peak_gib: float) -> None:
        """One completed optimizer step: ``gen_s`` generation (with the weight sync), ``train_s`` training."""
        info, k = self.info, self.k
        gen, sync, wake = (
            float(info.get("gen_s", 0.0)),
            float(info.get("sync_s", 0.0)),
            float(info.get("wake_s", 0.0)),
        )
        if gen_s > 0 and gen + sync > 0:
            scale = gen_s / (gen + sync)
            if not k.use_vllm:
                kind = "generate_hf"
            elif int(info.get("concurrency", FEW_SEQUENCES)) < FEW_SEQUENCES:
                kind = "generate_vllm_few"
            else:
                kind = "generate_vllm"
            self._add(wake * scale, "wake")
            self._add(gen * scale, kind)
            self._add(max(sync - wake, 0.0) * scale, "sync")
        parts = dict(info.get("micro_batch_parts") or {"compute": float(info.get("micro_batch_s", 0.0))})
        opt, misc = float(info.get("optimizer_s", 0.0)), float(info.get("misc_s", 0.0))
        planned = k.ga * sum(parts.values()) + opt + misc
        scale = train_s / planned if planned > 0 else 0.0
        for _ in range(k.ga):
            for name in ("compute", "hooks", "comm", "pcie"):
                self._add(parts.get(name, 0.0) * scale, name)
        self._add(opt * scale, "optimizer_cpu" if k.offload_opt else "optimizer_gpu")
        self._add(misc * scale, "misc")
        phase = "warmup" if number <= self.warmup else MEASURE
        self._flush(phase, lambda t: peak_gib, float(self.info.get("host_need_gib", 4.0)))

    def failing_step(
        self, number: int, seconds: float, gen_s: float, from_gib: float, cuda_oom: bool
    ) -> None:
        """The part of the step a trial died in: generation, then training, until the failure. A
        CUDA OOM shows the GPU filling up to its capacity, as NVML sees it just before the error."""
        gen = min(seconds, gen_s)
        self._add(gen, "generate_vllm" if self.k.use_vllm else "generate_hf")
        self._add(seconds - gen, "compute")
        start, cap = self.now, self.truth.capacity_gib
        to_gib = cap * 0.995 if cuda_oom else from_gib
        phase = "warmup" if number <= self.warmup else MEASURE

        def memory(t: float) -> float:
            return from_gib + (to_gib - from_gib) * min(max((t - start) / max(seconds, 1e-9), 0.0), 1.0)

        self._flush(phase, memory, float(self.info.get("host_need_gib", 4.0)))

    def _flush(self, phase: str, memory: Callable[[float], float], host_gib: float) -> None:
        """Write the samples due up to the end of the timeline so far, then flush the file."""
        end = self.segments[-1][1] if self.segments else 0.0
        cap = self.truth.capacity_gib
        train_levels = dict(LEVEL)
        serve_levels = {
            name: (LEVEL["generate_vllm"] if name.startswith("generate") else 0.0) for name in LEVEL
        }
        if self.k.server:  # the trainers wait on the server's HTTP answers while it generates
            train_levels.update({n: LEVEL["server_wait"] for n in LEVEL if n.startswith("generate")})
        while self.next_sample <= end:
            t = self.next_sample
            used = float(memory(t))
            cpu_offload = self._level_at(t) == "optimizer_cpu"
            readings = []
            for gpu in range(self.gpus):
                serving = gpu >= self.gpus - self.server_gpus
                levels = serve_levels if serving else train_levels
                mem = (self.k.util * cap + 0.6) if serving else (used if gpu == 0 else max(used - 0.3, 0.0))
                readings.append(GpuReading(gpu, round(self._util(t, levels)), min(mem, cap), cap))
            cpu = 100.0 * self.gpus * (1.0 + self.rng.uniform(-0.05, 0.05)) + (800.0 if cpu_offload else 0.0)
            tick = Tick(round(t, 3), phase, readings, host_rss_gib=host_gib, host_cpu_pct=cpu)
            self.writer.writerows(tick.rows())
            self.next_sample += self.interval
        self.now = end
        self.fh.flush()
