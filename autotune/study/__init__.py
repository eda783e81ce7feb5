"""The study remembers: Optuna storage, one folder per trial, ranking, recovery after a crash.

Everything ``resume``, ``show`` and ``export`` need is here or in the trial folders, so a search
can be killed at any moment and continued. This package imports only lower layers (the trial
contract and the recipe); the search above it decides, the study only records and ranks.
"""

from autotune.study.checks import check_database, held_trials, plain_failures
from autotune.study.paths import StudyPaths, prepare_root
from autotune.study.ranking import Confirmation, choose_best, confirmations, eligible, rank, save_confirmation
from autotune.study.record import TrialRow, candidate_key, launched_rows, measured_configs, record, rows
from autotune.study.recovery import recover_interrupted
from autotune.study.storage import check_storage, load_existing, open_study

__all__ = [
    "Confirmation",
    "StudyPaths",
    "TrialRow",
    "candidate_key",
    "check_database",
    "check_storage",
    "choose_best",
    "confirmations",
    "eligible",
    "held_trials",
    "launched_rows",
    "load_existing",
    "measured_configs",
    "open_study",
    "plain_failures",
    "prepare_root",
    "rank",
    "record",
    "recover_interrupted",
    "rows",
    "save_confirmation",
]
