"""Launch claims: how controllers sharing a study keep to its --trials and never measure twice.

A trial is *claimed* for a launch (user attributes ``launching``, ``pending_key``, ``candidate``)
before its process starts, under the study's ``claim`` lock (:class:`StudyLock`). The study's
launches are the finished launched trials plus the RUNNING claimed ones, whichever controller runs
them, so ``--trials`` is the study's total; and a candidate whose key is measured or claimed by a
running trial is not launched again, nor one told by another controller since this one looked
(``answered``, checked again under the lock). An interrupted trial (FAIL, never told a result) stops counting,
which frees its launch for the re-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.study.lock import StudyLock
from autotune.study.record import measured_configs
from autotune.trial.outcome import Status

LAUNCHING = "launching"
PENDING_KEY = "pending_key"


@dataclass
class Claim:
    """The answer to a claim: ``granted``, or why not (``full``: no launches left; ``running``:
    the same configuration is being measured by trial ``other``; ``measured``: trial ``other``
    already answered it, so it is answered from the study, not launched)."""

    granted: bool
    why: str = ""
    other: int | None = None


def answered(study: optuna.Study) -> dict[str, tuple[int, dict[str, Any]]]:
    """What a repeat proposal is answered from without a launch: measured and refused configs.

    A memory-model skip is not an answer: the model is re-fitted after every trial, so a candidate
    it vetoed early is asked again when proposed again. The scheduler's gate and :func:`claim` use
    this same list, so a claim refused as ``measured`` is always answered by the gate."""
    return {k: v for k, v in measured_configs(study).items() if v[1].get("status") != Status.SKIPPED}


def pending_keys(study: optuna.Study, *, exclude: int | None = None) -> dict[str, int]:
    """Keys of the configurations RUNNING trials were claimed for, to their trial numbers."""
    return {
        t.user_attrs[PENDING_KEY]: t.number
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if t.user_attrs.get(PENDING_KEY) and t.number != exclude
    }


def launches(study: optuna.Study) -> int:
    """The study's launches so far, every controller's: finished launched trials and running claims."""
    count = 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.RUNNING:
            count += bool(t.user_attrs.get(LAUNCHING))
        elif t.user_attrs.get("launched"):
            count += 1
    return count


def claim(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any], key: str, limit: int) -> Claim:
    """Claim ``trial`` for launching ``params``, unless the study's launches reached ``limit`` or the
    same configuration is running elsewhere or was measured since the caller looked. Held under the
    study's claim lock, across machines."""
    with StudyLock(study._storage, study.study_name, "claim"):  # noqa: SLF001
        done = answered(study).get(key)
        if done is not None:
            return Claim(False, "measured", done[0])
        if launches(study) >= limit:
            return Claim(False, "full")
        other = pending_keys(study, exclude=trial.number).get(key)
        if other is not None:
            return Claim(False, "running", other)
        trial.set_user_attr("candidate", params)
        trial.set_user_attr(PENDING_KEY, key)
        trial.set_user_attr(LAUNCHING, True)
    return Claim(True)
