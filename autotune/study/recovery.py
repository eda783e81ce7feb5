"""After a crash: close the trials a killed controller left running, and queue them again.

What is queued again must be the whole configuration the trial stood for, not ``trial.params``:
Optuna records a parameter only when it is suggested, so a controller killed half-way through
suggesting leaves half a configuration there, and queueing that lets the sampler fill the rest
with other values. The whole candidate is known earlier than its parameters are: the policy puts
it in the trial's ``fixed_params`` before any is suggested (as ``enqueue_trial`` does), the runner
writes it to the trial folder's params.json before launching, and ``record`` keeps it as the
``candidate`` user attribute.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.study.paths import StudyPaths
from autotune.study.record import candidate_key, record
from autotune.trial.outcome import Outcome
from autotune.trial.processes import kill_stale

log = logging.getLogger(__name__)


def _params_file(trial_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((trial_dir / "params.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data else None


def interrupted_candidate(trial: FrozenTrial, trial_dir: Path) -> tuple[dict[str, Any], str]:
    """The whole configuration an unfinished trial stood for, and where it was found.

    In order: the recorded candidate, the trial folder's params.json, the ``fixed_params`` the
    trial was given before suggesting (with what was suggested), and only then the parameters
    suggested before the stop ("partial": the rest will be chosen anew).
    """
    candidate = trial.user_attrs.get("candidate")
    if isinstance(candidate, dict) and candidate:
        return dict(candidate), "candidate"
    from_file = _params_file(trial_dir)
    if from_file is not None:
        return from_file, "params.json"
    fixed = trial.system_attrs.get("fixed_params")
    if isinstance(fixed, dict) and fixed:
        return {**trial.params, **fixed}, "fixed_params"
    return dict(trial.params), "partial"


def recover_interrupted(study: optuna.Study, paths: StudyPaths) -> list[int]:
    """Close trials a killed controller left RUNNING: kill their processes, mark them, retry them.

    The interrupted configuration is enqueued again, whole, since it was never measured.
    """
    recovered = []
    for pid_file in paths.root.glob("*/*/pid"):          # confirm/ and verify/ runs too
        kill_stale(pid_file.parent)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_dir = paths.trial_dir(trial.number)
        killed = kill_stale(trial_dir)
        params, source = interrupted_candidate(trial, trial_dir)
        finished = trial_dir / "outcome.json"
        if finished.exists():
            try:
                done = Outcome.read(finished)
            except (ValueError, OSError):
                done = None
            if done is not None and done.extra.get("launched") and done.status != "interrupted":
                # the trial ended and its outcome was written; only the telling was cut short
                record(study, optuna.trial.Trial(study, trial._trial_id), params, done,  # noqa: SLF001
                       launched=True, key=candidate_key(params), trial_dir=trial_dir)
                log.info("trial %d had finished (%s); its result was recorded on resume", trial.number, done.status)
                continue
        detail = "the controller stopped during this trial; it is run again on resume"
        if killed:
            detail += " (its leftover processes were killed)"
        if source == "partial" and params:
            detail += (f"; only {len(params)} of its parameters had been chosen, so the rest are chosen anew")
        outcome = Outcome(status="interrupted", detail=detail)
        trial_dir.mkdir(parents=True, exist_ok=True)
        outcome.write(trial_dir / "outcome.json")
        if params and source != "candidate":   # so that show lists what it stood for, not the half suggested
            study._storage.set_trial_user_attr(trial._trial_id, "candidate", params)   # noqa: SLF001
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        if params:
            study.enqueue_trial(params, skip_if_exists=False)
        recovered.append(trial.number)
        log.info("trial %d was interrupted; marked and queued again (configuration from %s)", trial.number, source)
    return recovered
