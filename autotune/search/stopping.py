"""When the search stops: trial count, time budget, an exhausted space, or the same crash again.

The time budget is the study's, not the session's: the time spent so far is kept in the study, so
a resumed search goes on with what is left of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from autotune.errors import SearchStopped
from autotune.trial.failure_texts import crash_signature
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import Outcome, Status

SAME_CRASH_LIMIT = 3  # the same crash this many times in a row ends the search
UNLAUNCHED_LIMIT = 300  # proposals in a row that need no launch, where the grid cannot be checked


class Budget:
    """The study's clock and how long recent trials took, to tell whether the next one fits."""

    def __init__(self, limit_s: float | None, elapsed_s: float, durations: list[float]) -> None:
        self.limit_s = limit_s
        self.start = time.monotonic() - elapsed_s
        self.durations = list(durations)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def spent(self, duration_s: float | None) -> None:
        self.durations.append(duration_s or 0.0)

    def exceeded(self, next_s: float | None = None) -> bool:
        """Would the next run pass the limit? It lasts ``next_s`` when known (a confirmation's
        own estimate), else as long as the longest of the last five trials."""
        if not self.limit_s:
            return False
        duration = next_s if next_s is not None else max(self.durations[-5:], default=0.0)
        return self.elapsed() + duration > self.limit_s


class Stopping:
    """Counts what the search did and says when to stop; raises on a repeated crash."""

    def __init__(self, budget: Budget, study_name: str) -> None:
        self.budget = budget
        self.study_name = study_name
        self.unlaunched = 0
        self.crashes: list[str] = []
        # whether no untried candidate is left that nothing rules out (the planner's grid), when known
        self.exhausted: Callable[[], bool] | None = None
        self.answers = 0  # trials answered so far (launched or not): the grid changes only with them
        self._checked_at = -1

    def reason(self) -> tuple[str, str] | None:
        """(reason, message for the user) when no further candidate should be proposed."""
        if self.budget.exceeded():
            return "time budget reached", "stopping: the next trial would exceed --time-budget"
        if self.exhausted is not None:
            # before every proposal whose grid changed (once per answer, not per poll): a spent grid
            # stops the search before the proposer is asked, so no repeat trial is ever made for it
            if self._checked_at != self.answers:
                self._checked_at = self.answers
                if self.exhausted():
                    return "space exhausted", (
                        "stopping: every untried candidate of the space is invalid or ruled out by a "
                        "measured failure or the calibrated memory model; the space is exhausted"
                    )
            if self.unlaunched < UNLAUNCHED_LIMIT:
                return None
            return "proposals stalled", (
                f"stopping: the last {UNLAUNCHED_LIMIT} proposals were all invalid, skipped or already "
                "measured, although untried candidates are left"
            )
        if self.unlaunched >= UNLAUNCHED_LIMIT:
            return "space exhausted", (
                f"stopping: the last {UNLAUNCHED_LIMIT} proposals were all invalid, "
                "skipped or already measured; the space is exhausted"
            )
        return None

    def not_launched(self) -> None:
        self.unlaunched += 1
        self.answers += 1

    def launched(self) -> None:
        self.unlaunched = 0

    def finished(self, outcome: Outcome, trial_dir: Path) -> None:
        """After a launched trial: the same crash :data:`SAME_CRASH_LIMIT` times in a row stops it all."""
        self.budget.spent(outcome.wall_time_s)
        self.answers += 1
        if outcome.status != Status.CRASH:
            self.crashes = []
            return
        self.crashes.append(crash_signature(outcome.error_line))
        if len(self.crashes) >= SAME_CRASH_LIMIT and len(set(self.crashes[-SAME_CRASH_LIMIT:])) == 1:
            raise SearchStopped(
                f"the same crash {SAME_CRASH_LIMIT} times in a row: {outcome.error_line} "
                f"(see {TrialFiles(trial_dir).stderr}; fix it, then autotune resume {self.study_name})"
            )
