"""``autotune run STUDY``: open the study, check the exported configuration, run it supervised."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from autotune.commands.inputs import context_for
from autotune.commands.opening import ROOM_FOR_STUDY, open_named
from autotune.errors import UsageError
from autotune.export import export_study
from autotune.export.layout import PARAMS_JSON
from autotune.production.supervisor import RunOptions, Supervisor
from autotune.runners import make_runner
from autotune.search.knobs import KnobMemory
from autotune.search.planner import Planner
from autotune.study import plain_failures, rows
from autotune.study.incidents import incidents
from autotune.trial.outcome import UNINFORMATIVE


def run_study(
    name: str,
    runs_dir: Path,
    options: RunOptions,
    *,
    max_completion_length: int | None = None,
) -> int:
    """Run best/params.json for ``options.steps`` steps under supervision; the exit status."""
    if options.steps < 1:
        raise UsageError(f"--steps {options.steps}: a production run trains at least 1 step")
    if options.max_restarts < 0:
        raise UsageError(f"--max-restarts {options.max_restarts} cannot be negative (0: never restart)")
    if options.save_steps < 0:
        raise UsageError(f"--save-steps {options.save_steps} cannot be negative (0: the default)")
    if options.memory_limit_gib is not None and options.memory_limit_gib <= 0:
        raise UsageError(f"--memory-limit {options.memory_limit_gib} must be a positive number of GiB")
    paths, recipe, study = open_named(name, runs_dir)
    params_file = paths.best / PARAMS_JSON
    if not params_file.exists():
        raise UsageError(f"{params_file} does not exist: run autotune export {name} first")
    try:
        exported = json.loads(params_file.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{params_file} is not valid JSON ({exc.msg}, line {exc.lineno}): "
            f"rewrite it with autotune export {name}"
        ) from None
    if not isinstance(exported, dict):
        raise UsageError(f"{params_file} must be a JSON object of parameter values")
    if max_completion_length is not None:
        if max_completion_length < 1:
            raise UsageError(f"--max-completion-length {max_completion_length} must be at least 1")
        recipe.max_completion_length = max_completion_length  # this run's, not the study's
    context = context_for(recipe)
    runner = make_runner(context)
    runner.check()
    # the same planner the search used: which knobs carry dominance comes from the study's space
    planner = Planner(
        context.model,
        recipe,
        context.gpu,
        use_model=recipe.device != "cpu",
        knobs=KnobMemory.of(context.space),
    )
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        for row in rows(study):
            if row.launched and row.status not in UNINFORMATIVE:
                planner.observe(
                    row.number, row.params, row.status, row.oom_kind, row.peak_memory_gib, row.throughput
                )
        supervisor = Supervisor(study, recipe, runner, context.space, planner, paths.root / "run")
        before = len(incidents(study))
        result = supervisor.run(exported, options)
        if len(incidents(study)) > before:  # best/ and summary.md now say the long run failed
            if not export_study(study, recipe, paths.best):
                # nothing measured is left to export: best/ is the user's, kept, but no longer right
                result.lines.append(
                    f"{paths.best} still holds the configuration that failed: no other configuration "
                    f"{name} measured ran ok; autotune resume {name} measures more"
                )
    for line in result.lines:
        print(line, file=sys.stdout if result.finished else sys.stderr)
    return result.exit_code
