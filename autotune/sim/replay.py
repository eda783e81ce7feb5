"""Run a candidate against the simulator's ground truth in-process, without a subprocess.

The benchmark scores search policies over thousands of trials; launching the simulated trainer
for each would cost hours of wall time for nothing the launcher tests do not already cover. This
executor replays the same truth (``landscape.evaluate``) step by step through the same stop rule,
pruner and outcome fields as a launched trial, and counts simulated seconds instead of sleeping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.runners.sim import SimRunner
from autotune.sim.landscape import evaluate
from autotune.trial.metrics import StepRecord, steady_throughput
from autotune.trial.outcome import Outcome

ERROR_LINES = {
    "cuda": "torch.OutOfMemoryError: CUDA out of memory.",
    "host": None,
    "vllm_kv": "ValueError: No available memory for the cache blocks.",
    "vllm_startup": (
        "ValueError: Free memory on device on startup is less than desired GPU memory utilization"
    ),
}


class TruthExecutor:
    """An Executor (see autotune.search.loop) backed by the simulator's truth; tracks simulated time."""

    def __init__(self, runner: SimRunner) -> None:
        self.runner = runner
        self.simulated_s = 0.0
        self.launches = 0

    def __call__(self, params: dict[str, Any], trial_dir: Path, number: int, control: Any) -> Outcome:
        spec = self.runner.build_spec(params, number)
        truth = evaluate(spec)
        self.launches += 1
        records: list[StepRecord] = []
        elapsed = truth.startup_s
        peak = truth.startup_peak_gib
        stopped = None
        fail_step = truth.failure.at_step if truth.failure else None
        for k, step_time in enumerate(truth.step_times, start=1):
            elapsed += step_time
            peak = max(peak, truth.peak_memory_gib[k - 1])
            records.append(
                StepRecord(
                    step=k,
                    step_time=step_time,
                    samples=truth.samples_per_step,
                    peak_memory_gib=round(peak, 3),
                )
            )
            control.on_step(records[-1])
            stopped = control.decide(records, k)
            if stopped:
                break
        wall = elapsed
        warmup = control.rule.warmup
        common = dict(
            peak_memory_gib=round(peak, 3) if records or fail_step is None else None,
            steps=len(records),
            step_times=[r.step_time for r in records],
        )
        if stopped is None and truth.failure is not None:
            wall = elapsed + truth.fail_after_s
            self.simulated_s += wall
            kind = truth.failure.kind
            if kind == "invalid":
                return Outcome(status="invalid", detail="rejected by TRL", wall_time_s=wall, **common)
            return Outcome(
                status="oom", oom_kind=kind, error_line=ERROR_LINES.get(kind), wall_time_s=wall, **common
            )
        self.simulated_s += wall
        throughput = steady_throughput(records, warmup, truth.samples_per_step)
        extra = {"pruned": True} if stopped == "pruned" else {}
        if throughput is None:
            return Outcome(status="crash", error_line="no steady-state steps", wall_time_s=wall, **common)
        return Outcome(status="ok", throughput=throughput, wall_time_s=wall, extra=extra, **common)
