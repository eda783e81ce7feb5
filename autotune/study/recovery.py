"""After a crash: close the trials a killed controller left running, and queue them again."""

from __future__ import annotations

import json
import logging

import optuna
from optuna.trial import TrialState

from autotune.study.paths import StudyPaths
from autotune.study.record import candidate_key, record
from autotune.trial.outcome import Outcome
from autotune.trial.processes import kill_stale

log = logging.getLogger(__name__)


def recover_interrupted(study: optuna.Study, paths: StudyPaths) -> list[int]:
    """Close trials a killed controller left RUNNING: kill their processes, mark them, retry them.

    The interrupted configuration is enqueued again, since it was never measured.
    """
    recovered = []
    for pid_file in paths.root.glob("*/*/pid"):          # confirm/ and verify/ runs too
        kill_stale(pid_file.parent)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_dir = paths.trial_dir(trial.number)
        killed = kill_stale(trial_dir)
        finished = trial_dir / "outcome.json"
        if finished.exists():
            try:
                done = Outcome.read(finished)
            except (ValueError, OSError):
                done = None
            if done is not None and done.extra.get("launched") and done.status != "interrupted":
                # the trial ended and its outcome was written; only the telling was cut short
                params = trial.user_attrs.get("candidate") or json.loads((trial_dir / "params.json").read_text())
                record(study, optuna.trial.Trial(study, trial._trial_id), params, done,  # noqa: SLF001
                       launched=True, key=candidate_key(params), trial_dir=trial_dir)
                log.info("trial %d had finished (%s); its result was recorded on resume", trial.number, done.status)
                continue
        outcome = Outcome(status="interrupted",
                          detail="the controller stopped during this trial; it is run again on resume"
                          + (" (its leftover processes were killed)" if killed else ""))
        trial_dir.mkdir(parents=True, exist_ok=True)
        outcome.write(trial_dir / "outcome.json")
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        if trial.params:
            study.enqueue_trial(trial.params, skip_if_exists=False)
        recovered.append(trial.number)
        log.info("trial %d was interrupted; marked and queued again", trial.number)
    return recovered
