"""``autotune dashboard STUDY``: optuna-dashboard on the study's storage, agreeing with the export.

optuna-dashboard (0.21) names as best trial the one with the highest objective among completed
trials (``storage.get_best_trial``), ignoring constraints. autotune exports something else: the
fastest trial that left the headroom free and, once leaders were re-run longer, the confirmed one
fastest by both its runs (:func:`autotune.study.ranking.choose_best`). The two can differ: the
trial with the highest short-trial throughput may be confirmed slower than another. Trial values
cannot be changed after they are told, so the dashboard started here is given a storage that
answers ``get_best_trial`` with the exported trial, recomputed on every request (a running search
may change it), and shows on every trial of the study a ``verdict`` user attribute (exported,
passed over and why, confirmed), as ``autotune show`` does. Nothing is written to the study.
Other studies in the same storage are served unchanged.

The constraint itself is stored where the dashboard reads it by :func:`autotune.study.record.record`.
optuna-dashboard is an optional extra (``pip install 'autotune[dashboard]'``); without it the
command fails with one line naming the extra.
"""

from __future__ import annotations

import copy
import importlib
import socket
import sys
from collections.abc import Container
from typing import Any

from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import UsageError
from autotune.recipe import Recipe
from autotune.study.paths import StudyPaths
from autotune.study.ranking import choose_best, confirmations_of, confirmed_verdict, eligible
from autotune.study.record import FINISHED, mark_risks, row_of

EXTRA = "pip install 'autotune[dashboard]'"
VERDICT = "verdict"  # the user attribute the dashboard shows with autotune's decision on a trial


def require_dashboard() -> None:
    """Fail with one line naming the extra when optuna-dashboard cannot be imported."""
    try:
        importlib.import_module("optuna_dashboard")  # a broken install fails here too, not only a missing one
    except ImportError as exc:
        raise UsageError(f"optuna-dashboard is not installed ({exc.msg or exc}): {EXTRA}") from None


def decisions(
    trials: list[FrozenTrial], study_attrs: dict[str, Any], recipe: Recipe
) -> tuple[int | None, dict[int, str]]:
    """The exported trial's number (None when nothing is exportable) and a verdict per trial number.

    The same decisions as the export and ``autotune show``: ranking, the headroom rule and the
    confirmation runs, read from the storage as they are now."""
    rows = mark_risks([row_of(t) for t in trials if t.state in FINISHED], study_attrs)
    confirmed = confirmations_of(study_attrs)
    best, _ = choose_best(rows, recipe, confirmed)
    passed: dict[int, str] = {}
    eligible(rows, recipe, confirmed, passed_over=passed)
    verdicts: dict[int, str] = {n: "passed over: " + why for n, why in passed.items()}
    by_number = {r.number: r for r in rows}
    for number, c in confirmed.items():
        if number not in verdicts and c.throughput:
            verdicts[number] = confirmed_verdict(by_number.get(number), c)
    if best is not None:
        verdicts[best.number] = "exported"
    return (best.number if best is not None else None), verdicts


class ExportedBestStorage(RDBStorage):
    """The study's RDB storage, whose best trial for ``study_name`` is the one autotune exports.

    Read-only in spirit: what it adds (the best trial, the ``verdict`` attributes) is computed from
    what is stored on each call and never written back.
    """

    def __init__(self, url: str, study_name: str, recipe: Recipe) -> None:
        super().__init__(url, skip_compatibility_check=True, skip_table_creation=True)
        self.study_name = study_name
        self.recipe = recipe
        self._study_id: int | None = None

    def _ours(self, study_id: int) -> bool:
        if self._study_id is None:
            try:
                self._study_id = self.get_study_id_from_name(self.study_name)
            except KeyError:
                return False
        return study_id == self._study_id

    def _decisions(
        self, study_id: int, trials: list[FrozenTrial] | None = None
    ) -> tuple[int | None, dict[int, str]]:
        trials = trials if trials is not None else super().get_all_trials(study_id, deepcopy=False)
        return decisions(trials, self.get_study_user_attrs(study_id), self.recipe)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        """The exported trial; before anything is exportable, Optuna's constrained best, else the
        plain best (the dashboard asks only when some trial completed)."""
        if not self._ours(study_id):
            return super().get_best_trial(study_id)
        trials = super().get_all_trials(study_id, deepcopy=False)
        number, _ = self._decisions(study_id, trials)
        if number is not None:
            best = copy.copy(self.get_trial(self.get_trial_id_from_study_id_trial_number(study_id, number)))
            best.user_attrs = {**best.user_attrs, VERDICT: "exported"}
            return best
        feasible = [
            t
            for t in trials
            if t.state == TrialState.COMPLETE
            and t.value is not None
            and all(c <= 0.0 for c in t.constraints.values())
        ]
        if feasible:
            return max(feasible, key=lambda t: t.value)
        return super().get_best_trial(study_id)

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        """The trials, each of this study with its ``verdict`` user attribute (empty when none)."""
        trials = super().get_all_trials(study_id, deepcopy=deepcopy, states=states)
        if not self._ours(study_id):
            return trials
        every = trials if states is None else super().get_all_trials(study_id, deepcopy=False)
        _, verdicts = self._decisions(study_id, every)
        out = []
        for trial in trials:
            shown = copy.copy(trial)
            shown.user_attrs = {**trial.user_attrs, VERDICT: verdicts.get(trial.number, "")}
            out.append(shown)
        return out


def serve(paths: StudyPaths, recipe: Recipe, *, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run optuna-dashboard on the study until interrupted (Ctrl-C)."""
    require_dashboard()
    from optuna_dashboard import run_server

    _check_address(host, port)
    storage, study_id = _open(paths, recipe)
    shown = f"[{host}]" if ":" in host else host
    print(
        f"optuna-dashboard for study '{paths.name}': http://{shown}:{port}/dashboard/studies/{study_id} "
        "(best trial = the exported one; Ctrl-C stops it)",
        flush=True,
    )
    try:
        run_server(storage, host=host, port=port)
    except OSError as exc:
        raise _address_error(host, port, exc) from None
    except KeyboardInterrupt:
        sys.stderr.write("\n")


def _open(paths: StudyPaths, recipe: Recipe) -> tuple[ExportedBestStorage, int]:
    """The study's storage through the same driver choice as the search (``postgresql://`` with only
    psycopg 3 installed must not fall back to SQLAlchemy's psycopg2), and any failure to open it as
    one line, as :mod:`autotune.study.storage` reports it."""
    from autotune.study.storage import driver_url, redact

    url = paths.storage_url(recipe)
    real = driver_url(url)  # a missing driver: its own one-line UsageError
    try:
        storage = ExportedBestStorage(real, paths.name, recipe)
        return storage, storage.get_study_id_from_name(paths.name)
    except KeyError:
        raise UsageError(
            f"the storage {redact(url)} has no study '{paths.name}': "
            "check --storage, or run autotune search first"
        ) from None
    except Exception as exc:  # sqlalchemy and optuna errors: bad URL, server down, permissions, no driver
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise UsageError(
            f"cannot open the study storage {redact(url)} ({exc.__class__.__name__}: {first}): "
            "check the host, port, user and database, and that the server runs"
        ) from None


def _check_address(host: str, port: int) -> None:
    """Refuse a port in use or a host that is not this machine's before the server announces itself
    (bottle prints "Listening on ..." before it binds)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself does
            probe.bind((host, port))
    except OSError as exc:
        raise _address_error(host, port, exc) from None


def _address_error(host: str, port: int, exc: OSError) -> UsageError:
    return UsageError(
        f"cannot serve on {host}:{port} ({exc.strerror or exc}): choose another --port or --host"
    )
