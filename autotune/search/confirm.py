"""Confirmation: re-run the leading candidates longer before anything is exported.

Configs within a few percent of capacity can pass a short trial and die steps later when
fragmentation creeps; a longer run at full lengths catches that before it is exported, and ranking
the survivors by their longer runs takes most of the noise out of the choice.
"""

from __future__ import annotations

from typing import Any, Callable

import optuna

from autotune.progress import Reporter
from autotune.recipe import Recipe
from autotune.search.planner import Planner
from autotune.search.stopping import Budget
from autotune.study import StudyPaths, confirmations, eligible, rows, save_confirmation
from autotune.trial.control import CONFIRM_FACTOR, StopRule, TrialControl
from autotune.trial.outcome import Outcome

CONFIRM_NUMBER_OFFSET = 100_000   # confirmation runs are numbered apart from search trials


def confirm(study: optuna.Study, recipe: Recipe, paths: StudyPaths, execute: Callable[..., Outcome],
            reporter: Reporter, planner: Planner | None, budget: Budget) -> int:
    """Run confirmations until ``recipe.confirm`` leaders held up (a few more runs are allowed for
    casualties); earlier sessions' confirmations count. Returns the runs made now."""
    limit = recipe.gpu_memory_gib * (1 - recipe.headroom)

    def held_up(c: dict[str, Any]) -> bool:
        return c.get("status") == "ok" and (recipe.device == "cpu" or (c.get("peak_memory_gib") or 0) <= limit)

    runs = 0
    held = sum(1 for c in confirmations(study).values() if held_up(c))
    while held < recipe.confirm and runs < recipe.confirm + 2:
        done = confirmations(study)
        candidates, _ = eligible(rows(study), recipe, done)
        todo = [r for r in candidates if r.number not in done]
        if not todo or budget.exceeded():
            break
        row = todo[0]
        trial_dir = paths.confirm_dir(row.number)
        reporter.message(f"confirming trial {row.number} with {recipe.measure_steps * CONFIRM_FACTOR} measured steps")
        control = TrialControl(StopRule.confirming(recipe), None, recipe.completions_per_step(row.params),
                               purpose="confirm")
        outcome = execute(row.params, trial_dir, CONFIRM_NUMBER_OFFSET + row.number, control)
        outcome.write(trial_dir / "outcome.json")
        save_confirmation(study, row.number, outcome)
        budget.spent(outcome.wall_time_s)
        if planner is not None and outcome.status == "oom":
            planner.observe(row.number, row.params, outcome.status, outcome.oom_kind, outcome.peak_memory_gib)
        reporter.message(f"confirmation of trial {row.number}: {outcome.status}"
                         + (f" {outcome.throughput:.3g}/s" if outcome.throughput else "")
                         + (f", peak {outcome.peak_memory_gib:.1f} GiB" if outcome.peak_memory_gib else ""))
        runs += 1
        if held_up(outcome.to_json()):
            held += 1
    return runs
