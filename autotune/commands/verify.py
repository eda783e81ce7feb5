"""``autotune verify``: best/params.json replayed as one longer trial with the study's runner.

The trial runs to warm-up + ``steps`` measured steps with no early stop and no pruning, in
runs/<study>/verify/<n>/, and is judged like any trial, plus the headroom rule. :func:`verify_best`
checks the file, runs it into a :class:`Verified`, and :func:`render` prints the verdict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.commands.inputs import context_for
from autotune.commands.opening import ROOM_FOR_STUDY, open_named
from autotune.errors import UsageError
from autotune.export.layout import PARAMS_JSON
from autotune.progress import short_params
from autotune.recipe import Recipe
from autotune.runners import Runner, make_runner
from autotune.study import StudyPaths, plain_failures
from autotune.study.ranking import headroom_limit
from autotune.trial.control import StopRule, TrialControl
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import Outcome, Status

VERIFY_NUMBER_OFFSET = 200_000  # verify runs are numbered apart from search trials and confirmations


@dataclass
class Verified:
    """How the longer run went and whether it held (ran ok with its peak inside the headroom)."""

    outcome: Outcome
    limit_gib: float | None  # the headroom limit, None on CPU without --memory-limit
    capacity_gib: float
    memory: str  # what the peak measures: "GPU" or "host RSS"

    @property
    def held(self) -> bool:
        peak = self.outcome.peak_memory_gib
        within = self.limit_gib is None or peak is None or peak <= self.limit_gib
        return self.outcome.status == Status.OK and within


def verify_best(name: str, runs_dir: Path, steps: int) -> bool:
    """Replay best/params.json as one longer trial with the study's runner: does it hold?"""
    paths, recipe, _ = open_named(name, runs_dir)
    params_file = paths.best / PARAMS_JSON
    params = read_params(params_file, name)
    if steps < 1:
        raise UsageError("--steps must be at least 1")
    context = context_for(recipe)
    runner = make_runner(context)
    check_params(params, params_file, recipe, runner, context.space)
    result = run_longer(paths, recipe, runner, context.space, params, steps)
    render(result)
    return result.held


def read_params(params_file: Path, name: str) -> Any:
    if not params_file.exists():
        raise UsageError(f"{params_file} does not exist: run autotune export {name} first")
    try:
        return json.loads(params_file.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{params_file} is not valid JSON ({exc.msg}, line {exc.lineno}): "
            f"rewrite it with autotune export {name}"
        ) from None


def check_params(params: Any, params_file: Path, recipe: Recipe, runner: Runner, space: Space) -> None:
    """Refuse a hand-edited params.json whose values the space or the runner's rules do not allow
    (pins, forced values and the derived accumulation may lie outside the space)."""
    forced = runner.forced()
    if not isinstance(params, dict):
        raise UsageError(f"{params_file} must be a JSON object of parameter values")
    for key, value in params.items():
        if (
            key in space.params
            and space.relevant(key, params)
            and not space.params[key].contains(value)
            and key not in recipe.pins
            and key not in forced
            and key != "gradient_accumulation_steps"
        ):
            raise UsageError(f"{params_file}: {key}={value!r} is not {space.params[key].allowed()}")
    broken = constraints.violations(params, recipe, runner.rules())
    if broken:
        raise UsageError(f"{params_file} cannot run here: {broken[0]}")


def run_longer(
    paths: StudyPaths, recipe: Recipe, runner: Runner, space: Space, params: dict[str, Any], steps: int
) -> Verified:
    """Run the candidate once, to warm-up + ``steps``, in the next free verify/<n>/ folder."""
    root = paths.root / "verify"
    number = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0)
    trial_dir = root / str(number)
    recipe.trial_timeout_s = recipe.trial_timeout_s * max(
        1.0, (recipe.warmup_steps + steps) / (recipe.warmup_steps + recipe.measure_steps)
    )
    stop_rule = StopRule(warmup=recipe.warmup_steps, measure=steps, adaptive=False, prune=False)
    print(f"verifying {short_params(params)} for {recipe.warmup_steps} + {steps} steps in {trial_dir}")
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        outcome = runner.run(
            params,
            trial_dir,
            VERIFY_NUMBER_OFFSET + number,
            TrialControl(
                stop_rule, None, constraints.samples_per_step(params, recipe, space), purpose="verify"
            ),
        )
        cpu = recipe.device == "cpu"
        result = Verified(
            outcome,
            headroom_limit(recipe),
            recipe.memory_limit_gib if cpu and recipe.memory_limit_gib else recipe.gpu_memory_gib,
            "host RSS" if cpu else "GPU",
        )
        outcome.extra["held"] = result.held
        outcome.write(TrialFiles(trial_dir).outcome)
    return result


def render(result: Verified) -> None:
    outcome, limit, cap = result.outcome, result.limit_gib, result.capacity_gib
    peak = outcome.peak_memory_gib
    kind = f"/{outcome.oom_kind}" if outcome.oom_kind else ""
    if outcome.status == Status.OK:
        print(f"throughput: {outcome.throughput:.4g} completions/s over {outcome.steps} steps")
    else:
        print(
            f"failed: {outcome.status}{kind} after {outcome.steps} steps: "
            f"{outcome.error_line or outcome.detail}"
        )
    if peak is not None:
        judged = (
            f"headroom limit {limit:.2f} GiB"
            if limit is not None
            else "no headroom judged without --memory-limit"
        )
        print(
            f"peak memory ({result.memory}): {peak:.2f} GiB of {cap:.2f} GiB capacity "
            f"({peak / cap:.0%}; {judged})"
        )
    if result.held:
        print("held: yes")
    elif outcome.status != Status.OK:
        print(f"held: NO (the run failed: {outcome.status}{kind})")
    else:
        print(f"held: NO (peak {peak:.2f} GiB is above the headroom limit {limit:.2f} GiB)")
