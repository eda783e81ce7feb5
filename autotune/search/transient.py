"""Crashes that say nothing about the configuration: re-run once, later.

On a cluster a few percent of trials die of something unrelated to what they measure: an NCCL
watchdog timeout (``c10::DistBackendError``) after a slow peer, a reset connection. Taking such a
crash as final can throw away the best candidate of the night. A crash is worth a second run when
its error is one of those known transient classes, or when candidates one knob away ran fine (the
configuration itself is then unlikely to be what broke), unless its error names the candidate's
own values (a refusal: :mod:`autotune.search.refusals`). A re-run is queued after the next trial
rather than at once, so a passing hiccup has time to pass. A broken command still stops the
search: three identical crashes in a row end it (``search/stopping.py``), re-runs included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.search.refusals import named
from autotune.study.record import crashed_alike
from autotune.trial.failure_texts import transient_error


def neighbours_fine(params: dict[str, Any], fine: Iterable[dict[str, Any]]) -> bool:
    """Whether a candidate one knob away from ``params`` ran fine."""
    for other in fine:
        differ = sum(1 for k in set(params) | set(other) if params.get(k) != other.get(k))
        if differ == 1:
            return True
    return False


@dataclass
class Reruns:
    """Crashed candidates waiting for their one re-run (by key), queued after the next trial."""

    waiting: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # keys already given their second chance

    def consider(
        self,
        key: str,
        params: dict[str, Any],
        error_line: str | None,
        detail: str | None,
        fine: Iterable[dict[str, Any]],
    ) -> bool:
        """After a crash: hold the candidate for a re-run if it deserves one (once per key)."""
        if key in self.done or key in self.waiting or named(error_line, params):
            return False  # (a crash naming the candidate's own values is a refusal, not a hiccup)
        if transient_error(error_line, detail) or neighbours_fine(params, fine):
            self.waiting[key] = dict(params)
            return True
        return False

    def after(
        self,
        study: Any,
        number: int,
        key: str,
        params: dict[str, Any],
        outcome: Any,
        fine: Iterable[dict[str, Any]],
    ) -> str | None:
        """After launched trial ``number`` was told: hold it if it is a crash worth a re-run, else
        queue the held ones in the study (Optuna's ``enqueue_trial``, the whole candidate); returns
        a message for the user, or None."""
        if outcome.status == "crash":
            if self.consider(key, params, outcome.error_line, outcome.detail, fine):
                return f"trial {number} crashed ({outcome.error_line}); it will run once more, later"
            return None
        alike = crashed_alike(study) if self.waiting else {}
        for held, again in self.due():
            if held not in alike:  # crashed twice alike while it waited: the crash is its own
                study.enqueue_trial(again, user_attrs={"rerun_of": number}, skip_if_exists=False)
        return None

    def due(self) -> list[tuple[str, dict[str, Any]]]:
        """The held candidates, now that another trial has run; each is re-run only once."""
        out = list(self.waiting.items())
        self.done.update(self.waiting)
        self.waiting.clear()
        return out
