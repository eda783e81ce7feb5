"""Run a candidate against a landscape's ground truth in-process, without a subprocess.

The benchmark scores search policies over thousands of trials; launching the simulated trainer
for each would cost hours of wall time for nothing the launcher tests do not already cover. These
executors replay the same truth step by step through the same stop rule, pruner and outcome
fields as a launched trial, count simulated seconds instead of sleeping, and judge a failure by
handing the text the trainer would print to autotune's real classifier (``trial.classify``).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.runners.sim import SimRunner
from autotune.sim import error_text, family_base
from autotune.sim.family_base import Env
from autotune.sim.landscape import evaluate, parse_spec
from autotune.sim.physics import Physics
from autotune.sim.truth import TrialTruth
from autotune.trial.classify import diagnose
from autotune.trial.metrics import StepRecord, steady_throughput
from autotune.trial.outcome import Outcome


def replay(truth: TrialTruth, control: Any, text: Callable[[], str]) -> tuple[Outcome, float]:
    """The outcome of one trial and the simulated seconds it took."""
    records: list[StepRecord] = []
    elapsed = truth.startup_s
    peak = truth.startup_peak_gib
    logged = truth.info.get("logs_memory", True)
    stopped = None
    for k, step_time in enumerate(truth.step_times, start=1):
        elapsed += step_time
        peak = max(peak, truth.peak_memory_gib[k - 1])
        records.append(
            StepRecord(
                step=k,
                step_time=step_time,
                samples=truth.samples_per_step,
                peak_memory_gib=round(peak, 3) if logged else None,
            )
        )
        control.on_step(records[-1])
        stopped = control.decide(records, k)
        if stopped:
            break
    shown = round(peak, 3) if logged and (records or truth.failure is None) else None
    common = dict(peak_memory_gib=shown, steps=len(records), step_times=[r.step_time for r in records])
    if stopped is None and truth.failure is not None:
        wall = elapsed + truth.fail_after_s
        rc = -9 if truth.failure.kind == "host" else 1
        verdict = diagnose(rc, "" if truth.failure.kind == "host" else text())
        return (
            Outcome(
                status=verdict.status,
                oom_kind=verdict.oom_kind,
                error_line=verdict.error_line,
                detail=verdict.detail,
                wall_time_s=wall,
                **common,
            ),
            wall,
        )
    throughput = steady_throughput(records, control.rule.warmup, truth.samples_per_step)
    if throughput is None:
        return Outcome(
            status="crash", error_line="no steady-state steps", wall_time_s=elapsed, **common
        ), elapsed
    return Outcome(
        status="ok", throughput=throughput, wall_time_s=elapsed, pruned=stopped == "pruned", **common
    ), elapsed


class TruthExecutor:
    """An Executor (see autotune.search.loop) backed by the GRPO simulator's truth, on a landscape's
    physics (neutral by default); tracks simulated time."""

    def __init__(self, runner: SimRunner, physics: Physics | None = None) -> None:
        self.runner = runner
        self.physics = physics
        self.simulated_s = 0.0
        self.launches = 0

    def spec(self, params: dict[str, Any], number: int, attempt: int = 0) -> dict[str, Any]:
        spec = self.runner.build_spec(params, number, attempt=attempt)
        if self.physics is not None:
            spec["physics"] = self.physics.to_json()
        return spec

    def __call__(self, params: dict[str, Any], trial_dir: Path, number: int, control: Any) -> Outcome:
        spec = self.spec(params, number, self.runner.attempt(number))
        truth = evaluate(spec)
        self.launches += 1
        outcome, wall = replay(truth, control, lambda: error_text.failure_text(spec, parse_spec(spec), truth))
        self.simulated_s += wall
        return outcome


class FamilyExecutor:
    """An Executor backed by another trainer family's truth (``ppo``, ``plain``)."""

    def __init__(
        self, truth: Callable[..., TrialTruth], env: Env, program: str, seed: int, steps: int
    ) -> None:
        self.truth, self.env, self.program = truth, env, program
        self.seed, self.steps = seed, steps
        self.launched: Counter[tuple[int, str]] = Counter()  # runs per (number, purpose)
        self.simulated_s = 0.0
        self.launches = 0

    def __call__(self, params: dict[str, Any], trial_dir: Path, number: int, control: Any) -> Outcome:
        # a run of the same number again (a confirmation after a transient crash) is another run
        self.launched[(number, control.purpose)] += 1
        again = self.launched[(number, control.purpose)] - 1
        seed = zlib.crc32(
            f"{self.seed}:{number}:{control.purpose}".encode() + (f":{again}".encode() if again else b"")
        )
        rule = control.rule
        needed = max(self.steps, rule.warmup + rule.measure + rule.extra + 2)
        truth = self.truth(params, self.env, seed, needed)
        self.launches += 1
        outcome, wall = replay(
            truth, control, lambda: family_base.failure_text(truth, self.env, self.program)
        )
        self.simulated_s += wall
        return outcome
