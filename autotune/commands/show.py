"""``autotune show``: the trials so far, best first, with what the export made of each.

:func:`trials_of` reads the study into a :class:`Shown` (the ranked rows, each one's verdict and
the memory model's prediction); :func:`render_json` and :func:`render_table` print it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.commands.opening import ROOM_FOR_STUDY, open_named
from autotune.progress import short_params
from autotune.recipe import Recipe
from autotune.study import TrialRow, candidate_key, plain_failures, rank, rows
from autotune.study.incidents import incidents, long_run_failures
from autotune.study.ranking import choose_best, confirmations, confirmed_verdict, eligible
from autotune.trial.outcome import DECIDED, Status

if TYPE_CHECKING:
    import optuna


@dataclass
class Shown:
    """A study as ``show`` presents it."""

    title: str
    ranked: list[TrialRow]  # best first
    verdicts: dict[int, str]  # what the export made of each trial: exported, passed over (why), confirmed
    predicted: dict[int, float | None]  # the planner's peak, predicted before each trial ran
    incidents: list[str] = field(default_factory=list)  # production runs' failures no short trial saw
    # the same incidents as records (``--json``), by the configuration that failed
    incident_records: dict[str, list[dict]] = field(default_factory=dict)

    def model_errors(self) -> list[float]:
        """Relative error of each prediction, over the launched trials that ran ok."""
        return [
            abs(self.predicted[r.number] - r.peak_memory_gib) / r.peak_memory_gib
            for r in self.ranked
            if r.launched and r.status == Status.OK and r.peak_memory_gib and self.predicted.get(r.number)
        ]


def show_study(name: str, runs_dir: Path, as_json: bool) -> None:
    paths, recipe, study = open_named(name, runs_dir)
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):  # may read pages of the database no open touched
        shown = trials_of(name, recipe, study)
        if as_json:
            render_json(shown)
        else:
            render_table(shown)


def trials_of(name: str, recipe: Recipe, study: optuna.Study) -> Shown:
    all_rows = rows(study)
    done = confirmations(study)
    failed = long_run_failures(study)
    best, _ = choose_best(all_rows, recipe, done, failed)
    passed: dict[int, str] = {}
    eligible(all_rows, recipe, done, passed_over=passed, failed_long=failed)

    def verdict(r: TrialRow) -> str:
        if best is not None and r.number == best.number:
            return "exported"
        if r.number in passed:
            return "passed over: " + passed[r.number]
        c = done.get(r.number)
        return confirmed_verdict(r, c) if c and c.throughput else ""

    ranked = rank(all_rows)
    trials = study.get_trials(deepcopy=False)
    found = incidents(study)
    records: dict[str, list[dict]] = {}
    for inc in found:
        records.setdefault(candidate_key(inc.params), []).append(
            {**asdict(inc), "line": f"production run {inc.line()}"}
        )
    launched = sum(1 for t in trials if t.user_attrs.get("launched"))
    return Shown(
        title=f"{name}: {launched} launched of {recipe.trials} "
        f"({recipe.model}, {recipe.gpus}x{recipe.gpu_type})",
        ranked=ranked,
        verdicts={r.number: verdict(r) for r in ranked},
        predicted={t.number: t.user_attrs.get("predicted_gib") for t in trials},
        incidents=[f"production run {inc.line()}" for inc in found],
        incident_records=records,
    )


def render_json(shown: Shown) -> None:
    """The ranked trials as a JSON list (its shape is what scripts read); a trial whose configuration
    failed in a production run carries that run's incidents, as records and as ``show`` prints them."""
    print(
        json.dumps(
            [
                {
                    **r.__dict__,
                    "verdict": shown.verdicts[r.number],
                    "incidents": shown.incident_records.get(candidate_key(r.params), []),
                }
                for r in shown.ranked
            ],
            indent=2,
            default=str,
        )
    )


def render_table(shown: Shown) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=shown.title)
    for col in ("trial", "status", "completions/s", "peak GiB", "predicted", "verdict", "params / reason"):
        table.add_column(col)
    for r in shown.ranked:
        status = f"oom/{r.oom_kind}" if r.status == Status.OOM else r.status
        if not r.launched and r.status not in DECIDED:
            status += " (repeat)"
        tail = (
            short_params(r.params)
            if r.status in (Status.OK, Status.OOM)
            else (r.error_line or r.reason or short_params(r.params))
        )
        if r.status == Status.OK and r.diagnosis:  # the low-utilization diagnosis, where people look
            tail += f"; {r.diagnosis}"
        pred = shown.predicted.get(r.number)
        table.add_row(
            str(r.number),
            status,
            f"{r.throughput:.4g}" if r.throughput else "-",
            f"{r.peak_memory_gib:.1f}"
            if r.peak_memory_gib
            else ("unmeasured" if r.status == Status.OK else "-"),
            f"{pred:.1f}" if pred else "-",
            shown.verdicts[r.number][:70],
            tail[:200],
        )
    console = Console(width=200)
    console.print(table)
    for line in shown.incidents:  # what a long run met that no short trial saw; never wrapped
        print(line)
    errors = shown.model_errors()
    if errors:
        console.print(
            f"memory model: mean error {sum(errors) / len(errors):.1%} over {len(errors)} trials "
            "that ran ok (each predicted before its trial ran, with what was known then)"
        )
