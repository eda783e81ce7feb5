"""Pruning: stop a trial early once its first measured steps show it cannot win."""

from __future__ import annotations

import optuna
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial


class BelowBestPruner(BasePruner):
    """Prune a trial whose reported throughput is below ``ratio`` x the best exportable trial.

    Median-style pruners compare a trial with the others at the same step; here every trial's
    intermediate value is already a throughput estimate, so the best finished one is the bar.
    The bar is Optuna's constrained best trial: OOM, invalid and skipped trials, and ok trials
    that peaked inside the headroom, violate the ``fits`` constraint and are never the bar.
    """

    def __init__(self, ratio: float = 0.5) -> None:
        self.ratio = ratio

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if trial.last_step is None:
            return False
        try:
            best = study.best_trial.value
        except ValueError:  # nothing completed, or nothing feasible yet
            return False
        return bool(best) and trial.intermediate_values[trial.last_step] < self.ratio * best
