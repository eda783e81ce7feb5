"""Telling Optuna what happened to a trial, and reading trials back as rows.

Every candidate the sampler proposes becomes an Optuna trial, including the ones never launched
(invalid, skipped, a repeat), so the sampler learns from all of them. OOM and invalid candidates
are completed trials that violate a constraint, never FAIL: Optuna's samplers skip failed trials
and would keep proposing the same region.

The constraint is stored twice on purpose. Optuna 5's ``Trial.set_constraint("fits", v)`` keeps it
under the system attribute ``constraints:fits``; optuna-dashboard 0.21 reads only the older
``constraints`` list, so without it the dashboard shows no constraint on any trial. Optuna 5 reads
both forms into ``FrozenTrial.constraints`` (as ``"fits"`` and ``"0"``, the same value), so its own
``best_trial`` and feasibility are unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.files import write_json
from autotune.trial.failure_texts import crash_signature, transient_error
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import UNINFORMATIVE, Outcome, Status

FEASIBLE, INFEASIBLE = 0.0, 1.0
CONSTRAINT = "fits"  # Optuna 5 constraint key: > 0 means the trial violated it
DASHBOARD_CONSTRAINTS = "constraints"  # the system attribute (a list) optuna-dashboard 0.21 shows
# outcome status -> (constraint, Optuna state). Crashes say nothing about the config's memory or
# speed, so they are FAIL (ignored by the sampler); a hang or timeout is a config to avoid.
TELL = {
    **{status: (INFEASIBLE, TrialState.COMPLETE) for status in Status if status not in UNINFORMATIVE},
    Status.OK: (FEASIBLE, TrialState.COMPLETE),
    **{status: (None, TrialState.FAIL) for status in UNINFORMATIVE},
}


@dataclass
class TrialRow:
    """One trial as the study remembers it: what was tried and what happened."""

    number: int
    params: dict
    status: str  # ok | oom | invalid | timeout | hang | crash | interrupted | skipped
    oom_kind: str | None = None
    throughput: float | None = None  # completions/s
    peak_memory_gib: float | None = None
    error_line: str | None = None
    wall_time_s: float | None = None
    reason: str | None = None  # why invalid / skipped / passed over
    launched: bool = True  # False: decided without a run (invalid, skipped, a repeat)
    pruned: bool = False  # stopped early for being clearly slower than the best
    mean_gpu_util: float | None = None  # over the measured steps, a fraction
    diagnosis: str | None = None  # the low-utilization diagnosis of a trial that ran ok, or None
    at_risk: str | None = None  # its peak was not measured and the search judges it near capacity: why
    long_run_clears: bool = False  # ... and a longer run that holds clears it (headroom.unmeasured_risks)
    step_pair: float | None = None  # log(t2 / t1) of its first two measured steps (ranking.step_noise)


def candidate_key(params: dict[str, Any]) -> str:
    """How the study recognises a configuration it has already measured."""
    return json.dumps(params, sort_keys=True, default=str)


def measured_configs(study: optuna.Study) -> dict[str, tuple[int, dict[str, Any]]]:
    """Configurations the study has an answer for (measured, skipped or refused, or crashed alike
    twice: :func:`crashed_alike`), by key: a trial that answered and its attributes. A repeat
    proposal is answered from here."""
    out = {
        t.user_attrs["key"]: (t.number, t.user_attrs)
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("key") and t.user_attrs.get("status") not in (None, *UNINFORMATIVE)
    }
    for key, last in crashed_alike(study).items():
        out.setdefault(key, last)
    return out


def crashed_alike(study: optuna.Study) -> dict[str, tuple[int, dict[str, Any]]]:
    """Configurations launched twice or more that crashed twice with the same error (numbers and
    paths blurred: :func:`crash_signature`), not one of the known transient classes, each with its
    last crash: the crash is the configuration's own (a layout the trainer refuses), not a hiccup's.
    A crash says nothing of memory, so it answers nothing by itself, and once a crashed candidate had
    had its one re-run the walk proposed it again and again: Megatron's "Cannot use sequence
    parallelism without tensor parallelism", twelve times in one search of a NeMo-RL-style trainer
    (docs/benchmarks-notes.md, thirty-ninth pass). Answered so, it is neither proposed nor launched
    again, in this search or a resumed one. One crash is not enough, so that a study stopped by a
    broken command (three crashes, each of another candidate) and resumed once the command is mended
    runs them again; a candidate that crashed twice alike stays closed (run it by hand, or start a
    new study)."""
    seen: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        line = a.get("error_line")
        if a.get("status") == "crash" and a.get("launched") and a.get("key") and line:
            if not transient_error(line):
                seen.setdefault(a["key"], []).append((t.number, a))
    out = {}
    for key, crashes in seen.items():
        signatures = [crash_signature(a.get("error_line")) for _, a in crashes]
        if len(signatures) > len(set(signatures)):
            out[key] = crashes[-1]
    return out


def record(
    study: optuna.Study,
    trial: optuna.Trial,
    params: dict[str, Any],
    outcome: Outcome,
    *,
    launched: bool,
    key: str,
    trial_dir: Path | None = None,
    memory_limit_gib: float | None = None,
) -> None:
    """Tell Optuna what happened and remember enough to rebuild every report from storage.

    A trial that ran but peaked inside the headroom (``memory_limit_gib``) cannot be exported, so
    the sampler sees it as slightly infeasible (by how far it went over), not as a target.
    """
    constraint, state = TELL[outcome.status]
    if (
        constraint == FEASIBLE
        and memory_limit_gib
        and outcome.peak_memory_gib
        and outcome.peak_memory_gib > memory_limit_gib
    ):
        constraint = (outcome.peak_memory_gib - memory_limit_gib) / memory_limit_gib
    attrs = {
        "status": outcome.status.value,
        "oom_kind": outcome.oom_kind,
        "throughput": outcome.throughput,
        "peak_memory_gib": outcome.peak_memory_gib,
        "error_line": outcome.error_line,
        "wall_time_s": outcome.wall_time_s,
        "launched": launched,
        "key": key,
        "candidate": params,
        "reason": outcome.detail,
        "mean_gpu_util": outcome.mean_gpu_util,
        "predicted_gib": outcome.predicted_gib,
        "pruned": outcome.pruned,
        "diagnosis": low_util_diagnosis(outcome),
        "step_pair": outcome.extra.get("step_pair"),
    }
    for name, value in attrs.items():
        trial.set_user_attr(name, value)
    if constraint is not None:
        trial.set_constraint(CONSTRAINT, constraint)
        # Optuna 5 has no public setter for a trial system attribute (set_system_attr is gone)
        trial.storage.set_trial_system_attr(trial._trial_id, DASHBOARD_CONSTRAINTS, [float(constraint)])
    if trial_dir is not None:
        trial_dir.mkdir(parents=True, exist_ok=True)
        outcome.launched = launched
        if not launched:
            write_json(TrialFiles(trial_dir).params, params)
        outcome.write(TrialFiles(trial_dir).outcome)
    if outcome.pruned:
        study.tell(trial, state=TrialState.PRUNED)
    elif state == TrialState.COMPLETE:
        study.tell(trial, outcome.throughput if outcome.status == "ok" else 0.0)
    else:
        study.tell(trial, state=state)


def row_of(trial: FrozenTrial) -> TrialRow:
    a = trial.user_attrs
    status = a.get("status") or ("interrupted" if trial.state == TrialState.FAIL else "running")
    return TrialRow(
        number=trial.number,
        params=dict(a.get("candidate") or trial.params),
        status=status,
        oom_kind=a.get("oom_kind"),
        throughput=a.get("throughput"),
        peak_memory_gib=a.get("peak_memory_gib"),
        error_line=a.get("error_line"),
        wall_time_s=a.get("wall_time_s"),
        reason=a.get("reason"),
        launched=bool(a.get("launched")),
        pruned=trial.state == TrialState.PRUNED,
        mean_gpu_util=a.get("mean_gpu_util"),
        diagnosis=a.get("diagnosis"),
        step_pair=a.get("step_pair") if isinstance(a.get("step_pair"), (int, float)) else None,
    )


def low_util_diagnosis(outcome: Outcome) -> str | None:
    """The low-utilization diagnosis of a trial that ran ok (the controller drops it for any other
    status: a dying run idles because it dies), else None."""
    if outcome.status != "ok" or not outcome.extra.get("low_util"):
        return None
    monitor = outcome.extra.get("monitor")
    text = monitor.get("diagnosis") if isinstance(monitor, dict) else None
    return text or outcome.detail


def launched_rows(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("launched")]


AT_RISK_ATTR = "at_risk"  # study user attribute: {trial number: why its unmeasured peak is near capacity}
LONG_RUN_CLEARS_ATTR = "at_risk_long_run"  # [trial number]: those of them a held confirmation clears


#: the trial states a row is made of (finished, or interrupted and told as failed)
FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def rows(study: optuna.Study) -> list[TrialRow]:
    """All finished or interrupted trials, as the reports want them."""
    out = [row_of(t) for t in study.get_trials(deepcopy=False) if t.state in FINISHED]
    return mark_risks(out, study.user_attrs)


def mark_risks(rows_: list[TrialRow], attrs: dict[str, Any]) -> list[TrialRow]:
    """Each row's unmeasured-peak verdict, from the study's attributes (what the search judged)."""
    risky = attrs.get(AT_RISK_ATTR) or {}
    clears = set(attrs.get(LONG_RUN_CLEARS_ATTR) or ())
    for row in rows_:
        row.at_risk = risky.get(str(row.number))
        row.long_run_clears = row.at_risk is not None and str(row.number) in clears
    return rows_
