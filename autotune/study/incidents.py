"""Incidents of production runs: the exported configuration failed in a long run.

A search measures short trials; ``autotune run`` then trains for hours and may meet what no trial
saw (completions that grow, a fragmenting allocator). Each failure of the run is kept in the study
itself (a user attribute of the Optuna study, so shared studies see it too), because it is the
strongest evidence the study has about that configuration: ``show``, summary.md and the report
name it, the export passes the configuration over, and the next search's planner learns it as an
out-of-memory of its kind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

from autotune.study.record import candidate_key

PREFIX = "incident:"


@dataclass
class Incident:
    """One failure of a production run and what the run did about it."""

    number: int  # 1, 2, ... within the study
    attempt: int  # the run attempt that failed (runs/<study>/run/attempts/<n>)
    status: str  # oom | hang | timeout | crash
    oom_kind: str | None
    step: int  # the optimizer step the attempt died in (one past the last it reported)
    error_line: str | None
    params: dict[str, Any] = field(default_factory=dict)  # the configuration that failed
    resumed_from: str | None = None  # the checkpoint the next attempt resumes from
    switched_to: dict[str, Any] | None = None  # the configuration of the next attempt (None: stopped)
    source: str | None = None  # where switched_to comes from ("trial 3", "probe 1", "same configuration")

    @property
    def kind(self) -> str:
        return f"{self.status}/{self.oom_kind}" if self.oom_kind else self.status

    def line(self) -> str:
        """The incident in one line, as ``show`` and the run's last words print it."""
        what = f"incident {self.number}: {self.kind} at step {self.step} of run attempt {self.attempt}"
        error = f": {self.error_line}" if self.error_line else ""
        if self.switched_to is None:
            then = "; stopped"
        else:
            changes = {k: v for k, v in self.switched_to.items() if self.params.get(k) != v}
            shown = ", ".join(f"{k}={v}" for k, v in sorted(changes.items())) or "the same configuration"
            then = f"; restarted with {shown}" + (f" ({self.source})" if self.source else "")
            if self.resumed_from:
                then += f" from {self.resumed_from}"
        return what + error[:160] + then


def save_incident(study: optuna.Study, incident: Incident) -> None:
    study.set_user_attr(f"{PREFIX}{incident.number}", asdict(incident))


def incidents(study: optuna.Study) -> list[Incident]:
    """Every incident the study holds, in order."""
    found = [
        Incident(**value)
        for key, value in study.user_attrs.items()
        if key.startswith(PREFIX) and isinstance(value, dict)
    ]
    return sorted(found, key=lambda i: i.number)


def failed_long(found: list[Incident]) -> dict[str, str]:
    """Configurations that ran out of memory or hung in a long run, by candidate key, with why:
    the export passes them over (a crash says nothing about the configuration)."""
    out: dict[str, str] = {}
    for inc in found:
        if inc.status in ("oom", "hang"):
            out.setdefault(
                candidate_key(inc.params),
                f"it failed in a long run ({inc.kind} at step {inc.step}, incident {inc.number})",
            )
    return out


def long_run_failures(study: optuna.Study) -> dict[str, str]:
    """:func:`failed_long` of the study's incidents: what ``choose_best`` passes over."""
    return failed_long(incidents(study))
