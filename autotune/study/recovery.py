"""After a crash: close the trials a killed controller left running, and queue them again.

What is queued again must be the whole configuration the trial stood for, not ``trial.params``:
Optuna records a parameter only when it is suggested, so a controller killed half-way through
suggesting leaves half a configuration there, and queueing that lets the sampler fill the rest
with other values. The whole candidate is known earlier than its parameters are: the policy puts
it in the trial's ``fixed_params`` before any is suggested (as ``enqueue_trial`` does), the runner
writes it to the trial folder's params.json before launching, and ``record`` keeps it as the
``candidate`` user attribute.

Several controllers may share a study (parallel nodes on PostgreSQL, or a second search on the same
SQLite file), so a RUNNING trial is only taken over when its controller is provably gone: it ran on
this machine and its process is dead, or Optuna's heartbeat says so (no heartbeat for the grace
period; :class:`RetryInterrupted` then queues it again, as Optuna's RetryFailedTrialCallback does,
but with the whole candidate). A live controller's trials, and their processes, are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from autotune.study.paths import StudyPaths
from autotune.study.record import candidate_key, record
from autotune.trial.outcome import Outcome
from autotune.trial.processes import kill_stale

log = logging.getLogger(__name__)

OWNER_ATTR = "autotune:owner"      # trial system attribute: "host:pid" of the controller running it
RETRY_ATTR = "retry_of"            # trial user attribute: the interrupted trial this one re-runs
MAX_RETRIES = 3                    # a configuration interrupted this often is not queued again


def node_name() -> str:
    """This machine's name in a shared study: ``AUTOTUNE_NODE``, else the host name. Containers on
    different machines can share a host name (and pid numbers); give each node its own then."""
    return os.environ.get("AUTOTUNE_NODE") or socket.gethostname()


def claim_owner(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> None:
    """Mark a trial as this controller's, so another one on this machine can tell if it died."""
    study._storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR,   # noqa: SLF001
                                         f"{node_name()}:{psutil.Process().pid}")


def owner_gone(trial: FrozenTrial) -> bool:
    """Whether the controller that runs ``trial`` is provably dead (same host, process gone or
    replaced). A trial with no owner is taken as dead: an older autotune's, or one whose controller
    died inside ``ask`` (the owner is written first thing in the sampler's ``before_trial``; a live
    controller that loses a trial in that instant asks again, see search/parallel.py)."""
    owner = trial.system_attrs.get(OWNER_ATTR)
    if not owner:
        return True
    host, _, pid = str(owner).rpartition(":")
    if host != node_name() or not pid.isdigit():
        return False                     # another machine: only its heartbeat can tell
    try:
        proc = psutil.Process(int(pid))
        started = trial.datetime_start.timestamp() if trial.datetime_start else time.time()
        return proc.create_time() > started + 1 or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


class RetryInterrupted:
    """Heartbeat-stale trial callback: queue the interrupted candidate again, whole.

    Optuna's ``RetryFailedTrialCallback`` re-enqueues ``trial.params``, which is half a candidate
    when the controller died while suggesting, and copies every attribute (our proposal mark would
    then count a seed twice). This one enqueues the whole candidate (see
    :func:`interrupted_candidate`), kills what the trial left running when its folder is on this
    machine, and writes its outcome.json there."""

    def __init__(self, paths: StudyPaths | None = None) -> None:
        self.paths = paths

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        trial_dir = self.paths.trial_dir(trial.number) if self.paths is not None else Path("/nonexistent")
        params, source = interrupted_candidate(trial, trial_dir)
        killed = kill_stale(trial_dir) if trial_dir.is_dir() else False
        if trial_dir.is_dir() and not (trial_dir / "outcome.json").exists():   # never overwrite a result
            detail = "its controller stopped sending heartbeats; the trial is run again by another one"
            Outcome(status="interrupted", detail=detail + (" (its leftover processes were killed)" if killed
                                                           else "")).write(trial_dir / "outcome.json")
        queue_again(study, trial, params, source)


def label(study: optuna.Study, trial: FrozenTrial, params: dict[str, Any], source: str) -> None:
    """Keep the whole candidate on a trial about to be failed, so that show lists what it stood
    for, not the half that was suggested (a finished trial can no longer be written)."""
    if params and source != "candidate":
        study._storage.set_trial_user_attr(trial._trial_id, "candidate", params)   # noqa: SLF001


def queue_again(study: optuna.Study, trial: FrozenTrial, params: dict[str, Any], source: str) -> None:
    """Enqueue an interrupted candidate for whichever controller asks next (up to MAX_RETRIES)."""
    history = [*trial.user_attrs.get("retry_history", []), trial.number]
    if not params or len(history) > MAX_RETRIES:
        log.warning("trial %d was interrupted %d times; not queued again", trial.number, len(history))
        return
    study.enqueue_trial(params, user_attrs={RETRY_ATTR: trial.number, "retry_history": history},
                        skip_if_exists=False)
    log.info("trial %d was interrupted; queued again (configuration from %s)", trial.number, source)


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


def recover_interrupted(study: optuna.Study, paths: StudyPaths, *, sweep: bool = False) -> list[int]:
    """Close trials a dead controller left RUNNING: kill their processes, mark them, retry them.

    The interrupted configuration is enqueued again, whole, since it was never measured. Only
    trials whose controller is gone are touched (:func:`owner_gone` on this machine, Optuna's
    heartbeat across machines). ``sweep`` also kills what confirmation and verify runs left; the
    caller passes it only when no other controller can be confirming (it holds the finish lock).
    """
    recovered = []
    if sweep:   # what finished trials, confirmation and verify runs left (a running trial is its owner's)
        running = {str(t.number) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        for pid_file in paths.root.glob("*/*/pid"):
            if pid_file.parent.parent.name != "trials" or pid_file.parent.name not in running:
                kill_stale(pid_file.parent)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not owner_gone(trial):
            continue
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
                try:
                    record(study, optuna.trial.Trial(study, trial._trial_id), params, done,  # noqa: SLF001
                           launched=True, key=candidate_key(params), trial_dir=trial_dir)
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue             # another controller recorded it first
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
        try:
            label(study, trial, params, source)
            if not study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):  # noqa: SLF001
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue                     # another controller took it over first
        queue_again(study, trial, params, source)
        recovered.append(trial.number)
    with warnings.catch_warnings():               # fail_stale_trials is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)   # other machines' dead controllers: RetryInterrupted
    return recovered
