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

A trial's heartbeat is recorded as soon as its owner is (inside ``ask``), so a controller killed
while asking leaves a trial that goes stale like any other; another machine's trial with no heartbeat
at all is taken as dead once it is older than the grace period. Heartbeats are sent by
:class:`Heartbeat`, which outlives a failed write: Optuna's own thread dies at its first error (a
PostgreSQL restart, SQLite's "database is locked"), and its live trial would be failed a minute later.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.storages._heartbeat import BaseHeartbeatThread, is_heartbeat_enabled
from optuna.trial import FrozenTrial, TrialState

from autotune.study.paths import StudyPaths
from autotune.study.record import candidate_key, record
from autotune.trial.layout import PARAMS, TrialFiles
from autotune.trial.outcome import Outcome, Status, read_outcome
from autotune.trial.processes import kill_stale

log = logging.getLogger(__name__)

OWNER_ATTR = "autotune:owner"  # trial system attribute: "host:pid" of the controller running it
RETRY_ATTR = "retry_of"  # trial user attribute: the interrupted trial this one re-runs
MAX_RETRIES = 3  # a configuration interrupted this often is not queued again


def node_name() -> str:
    """This machine's name in a shared study: ``AUTOTUNE_NODE``, else the host name. Containers on
    different machines can share a host name (and pid numbers); give each node its own then."""
    return os.environ.get("AUTOTUNE_NODE") or socket.gethostname()


def claim_owner(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> None:
    """Mark a trial as this controller's, so another one on this machine can tell if it died, and
    record its first heartbeat at once, so that another machine can tell too (Optuna's stale check
    skips a trial with no heartbeat at all, and the heartbeat thread starts only after ``ask``)."""
    storage = study._storage  # noqa: SLF001
    storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, f"{node_name()}:{psutil.Process().pid}")
    if is_heartbeat_enabled(storage):
        try:
            storage.record_heartbeat(trial._trial_id)  # type: ignore[attr-defined]
        except Exception as exc:  # a blip: the trial's Heartbeat starts right after ask and tries again
            log.warning("first heartbeat of trial %d not recorded: %s", trial.number, exc)


class Heartbeat(BaseHeartbeatThread):
    """A running trial's heartbeat that survives a failed write: the error is logged and the next
    beat tries again (Optuna's HeartbeatThread ends at its first exception, and the trial it stood
    for is then failed and its processes killed by whichever controller looks next)."""

    def __init__(self, trial_id: int, storage: optuna.storages.BaseStorage) -> None:
        self.trial_id, self.storage = trial_id, storage
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not is_heartbeat_enabled(self.storage):
            return
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat {self.trial_id}", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _beat(self) -> None:
        interval = self.storage.get_heartbeat_interval()  # type: ignore[attr-defined]
        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)  # type: ignore[attr-defined]
            except Exception as exc:  # the storage comes back; a missed beat is not a dead trial
                log.warning(
                    "heartbeat of trial %d not recorded (%s); trying again",
                    self.trial_id,
                    str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__,
                )
            if self._stop.wait(interval):
                return


def owner_alive_here(trial: FrozenTrial) -> bool:
    """Whether ``trial``'s controller runs on this machine and is alive (a stale heartbeat of such
    a trial is a heartbeat that failed, not a dead controller: it is never killed for it)."""
    owner = str(trial.system_attrs.get(OWNER_ATTR) or "")
    return owner.rpartition(":")[0] == node_name() and not owner_gone(trial)


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
        return False  # another machine: only its heartbeat can tell
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
        if owner_alive_here(trial):
            # (recover_interrupted never fails such a trial; Optuna's own fail_stale_trials may have)
            log.warning(
                "trial %d was failed for a late heartbeat while its controller (pid %s) is alive; "
                "its processes and folder are left alone",
                trial.number,
                str(trial.system_attrs.get(OWNER_ATTR)).rpartition(":")[2],
            )
            return
        trial_dir = self.paths.trial_dir(trial.number) if self.paths is not None else Path("/nonexistent")
        params, source = interrupted_candidate(trial, trial_dir)
        killed = kill_stale(trial_dir) if trial_dir.is_dir() else False
        if trial_dir.is_dir() and not TrialFiles(trial_dir).outcome.exists():  # never overwrite a result
            detail = "its controller stopped sending heartbeats; the trial is run again by another one"
            Outcome(
                status="interrupted",
                detail=detail + (" (its leftover processes were killed)" if killed else ""),
            ).write(TrialFiles(trial_dir).outcome)
        queue_again(study, trial, params, source)


def label(study: optuna.Study, trial: FrozenTrial, params: dict[str, Any], source: str) -> None:
    """Keep the whole candidate on a trial about to be failed, so that show lists what it stood
    for, not the half that was suggested (a finished trial can no longer be written)."""
    if params and source != "candidate":
        study._storage.set_trial_user_attr(trial._trial_id, "candidate", params)  # noqa: SLF001


def queue_again(study: optuna.Study, trial: FrozenTrial, params: dict[str, Any], source: str) -> None:
    """Enqueue an interrupted candidate for whichever controller asks next (up to MAX_RETRIES)."""
    history = [*trial.user_attrs.get("retry_history", []), trial.number]
    if not params or len(history) > MAX_RETRIES:
        log.warning("trial %d was interrupted %d times; not queued again", trial.number, len(history))
        return
    study.enqueue_trial(
        params, user_attrs={RETRY_ATTR: trial.number, "retry_history": history}, skip_if_exists=False
    )
    log.info("trial %d was interrupted; queued again (configuration from %s)", trial.number, source)


def _params_file(trial_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(TrialFiles(trial_dir).params.read_text())
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
        return from_file, PARAMS
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
    if sweep:  # what finished trials, confirmation and verify runs left (a running trial is its owner's)
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
        finished = TrialFiles(trial_dir).outcome
        if finished.exists():
            done = read_outcome(finished)  # a damaged file: said in one line, the trial runs again
            if done is not None and done.launched and done.status != Status.INTERRUPTED:
                # the trial ended and its outcome was written; only the telling was cut short
                try:
                    record(
                        study,
                        optuna.trial.Trial(study, trial._trial_id),
                        params,
                        done,  # noqa: SLF001
                        launched=True,
                        key=candidate_key(params),
                        trial_dir=trial_dir,
                    )
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue  # another controller recorded it first
                log.info(
                    "trial %d had finished (%s); its result was recorded on resume", trial.number, done.status
                )
                continue
        detail = "the controller stopped during this trial; it is run again on resume"
        if killed:
            detail += " (its leftover processes were killed)"
        if source == "partial" and params:
            detail += f"; only {len(params)} of its parameters had been chosen, so the rest are chosen anew"
        outcome = Outcome(status=Status.INTERRUPTED, detail=detail)
        trial_dir.mkdir(parents=True, exist_ok=True)
        outcome.write(TrialFiles(trial_dir).outcome)
        try:
            label(study, trial, params, source)
            if not study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):  # noqa: SLF001
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another controller took it over first
        queue_again(study, trial, params, source)
        recovered.append(trial.number)
    fail_stale(study)  # other machines' dead controllers: RetryInterrupted
    return recovered


def silent_elsewhere(study: optuna.Study, trial: FrozenTrial) -> bool:
    """Another machine's RUNNING trial that never sent a heartbeat and is older than the grace
    period: its controller died inside ``ask`` (before this version recorded the first heartbeat
    there), and Optuna's stale check, which skips trials without one, would wait for it forever."""
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    rdb = getattr(study._storage, "_backend", study._storage)  # noqa: SLF001  (Optuna's cache wraps it)
    if (
        not isinstance(rdb, optuna.storages.RDBStorage)
        or not is_heartbeat_enabled(rdb)
        or not trial.datetime_start
    ):
        return False
    grace = rdb.grace_period or 2 * (rdb.heartbeat_interval or 0)
    if datetime.now() - trial.datetime_start <= timedelta(seconds=grace):
        return False
    with _create_scoped_session(rdb.scoped_session) as session:
        return models.TrialHeartbeatModel.where_trial_id(trial._trial_id, session) is None


def fail_stale(study: optuna.Study) -> None:
    """Optuna's ``fail_stale_trials``, except for trials whose controller is alive on this machine
    (their heartbeat failed, they did not), plus other machines' trials that never sent a heartbeat
    (:func:`silent_elsewhere`); each failed trial goes to the storage's callback (RetryInterrupted)."""
    storage = study._storage  # noqa: SLF001
    if not is_heartbeat_enabled(storage):
        return
    stale = set(storage._get_stale_trial_ids(study._study_id))  # noqa: SLF001
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if owner_alive_here(trial) or (trial._trial_id not in stale and not silent_elsewhere(study, trial)):
            continue
        try:
            if storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                failed.append(trial._trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another controller failed it first
    callback = storage.get_heartbeat_stale_trial_callback()
    for trial_id in failed:
        if callback is not None:
            callback(study, storage.get_trial(trial_id))
