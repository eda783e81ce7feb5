"""Waiting out a storage outage: a PostgreSQL restart, an SQLite write lock another program holds.

A search runs for hours; the database it records into may restart, fail over or be locked by a
backup for seconds or minutes. Every storage call of a search waits such an outage out, up to
:func:`outage_limit_s` (5 minutes; ``AUTOTUNE_STORAGE_OUTAGE_S``), with one line when it starts
waiting and one when the storage is back. A longer outage ends the command with one line; the
study is resumable (what was running is recovered by the next ``resume``).

Only errors that say the storage is unreachable or busy are waited for: a damaged file, a full
disk or a wrong URL are not outages and surface at once. Heartbeats are not waited for here: a
missed beat is retried on the next one (:class:`autotune.study.recovery.Heartbeat`).

A call retried after its commit reached the server but its answer was lost may act twice; Optuna's
own writes are keyed (a trial finished twice is refused, a study created twice is loaded), and the
trial claims hold under the study lock, so the worst case is one extra Optuna trial number.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
import sqlalchemy.exc

from autotune.errors import UsageError, causes, no_space

log = logging.getLogger(__name__)

OUTAGE_S = 300.0
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 5.0
# what the drivers say when the server is away or the file is locked (sqlite3, psycopg, psycopg2)
UNREACHABLE = (
    "database is locked",
    "database table is locked",
    "connection refused",
    "could not connect",
    "connection to server",
    "server closed the connection",
    "terminating connection",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "connection is closed",
    "connection already closed",
    "consuming input failed",
    "ssl syscall",
    "connection reset",
    "broken pipe",
    "no route to host",
)
# the first creation of Optuna's tables by two controllers at the same moment: the loser's error
CREATION_RACE = ("alembic_version", "already exists", "unique constraint failed", "duplicate key")

T = TypeVar("T")


class StorageOutage(UsageError):
    """The storage stayed away longer than the limit: one line, the study can be resumed."""

    exit_code = 1


def outage_limit_s() -> float:
    """How long an outage is waited out; ``AUTOTUNE_STORAGE_OUTAGE_S`` changes it (tests: seconds)."""
    try:
        return max(0.0, float(os.environ.get("AUTOTUNE_STORAGE_OUTAGE_S", OUTAGE_S)))
    except ValueError:
        return OUTAGE_S


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage is away or busy, rather than damaged, full or misused."""
    if no_space(exc)[0]:
        return False
    for err in causes(exc):
        if isinstance(err, (sqlalchemy.exc.DisconnectionError, sqlalchemy.exc.InvalidatePoolError)):
            return True
        if isinstance(err, sqlalchemy.exc.DBAPIError) and err.connection_invalidated:
            return True
        driver = isinstance(err, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError))
        driver = driver or type(err).__module__.startswith(("psycopg", "sqlite3"))
        if driver and any(words in str(err).lower() for words in UNREACHABLE):
            return True
    return False


def creation_race(exc: BaseException) -> bool:
    """Whether ``exc`` is another controller creating the same new database's tables first."""
    return any(any(w in str(err).lower() for w in CREATION_RACE) for err in causes(exc))


_local = threading.local()


def patiently(what: str, call: Callable[[], T], *, url: str, limit_s: float | None = None) -> T:
    """``call()``, repeated while the storage is unreachable, up to the outage limit.

    Nested calls (an Optuna method calling another) wait only at the outermost level, so one outage
    is waited out once. Says once when it starts waiting and once when the storage is back.
    """
    if getattr(_local, "depth", 0):
        return call()
    limit = outage_limit_s() if limit_s is None else limit_s
    started: float | None = None
    pause = FIRST_PAUSE_S
    _local.depth = 1
    try:
        while True:
            try:
                result = call()
            except Exception as exc:
                if not unreachable(exc):
                    raise
                now = time.monotonic()
                if started is None:
                    started = now
                    log.warning(
                        "the study storage %s is unreachable (%s); waiting up to %s for it to come back",
                        url,
                        first_line(exc),
                        format_seconds(limit),
                    )
                if now - started >= limit:
                    raise StorageOutage(
                        f"the study storage {url} was unreachable for {format_seconds(now - started)}, "
                        f"longer than the {format_seconds(limit)} waited ({first_line(exc)}): the study is "
                        "saved; continue with autotune resume once the storage is back"
                    ) from None
                time.sleep(min(pause, max(0.0, limit - (now - started))))
                pause = min(pause * 2, MAX_PAUSE_S)
                continue
            if started is not None:
                log.warning(
                    "the study storage %s is back after %s (%s)",
                    url,
                    format_seconds(time.monotonic() - started),
                    what,
                )
            return result
    finally:
        _local.depth = 0


def format_seconds(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def first_line(exc: BaseException) -> str:
    """The driver's own words, one line (SQLAlchemy appends SQL and a link to its docs)."""
    for err in causes(exc):
        if type(err).__module__.startswith(("psycopg", "sqlite3")):
            exc = err
            break
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


class PatientStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage whose every call waits out an outage (see the module's docstring)."""

    url_for_messages = ""


def _patient(name: str) -> Callable[..., Any]:
    method = getattr(optuna.storages.RDBStorage, name)

    @functools.wraps(method)
    def call(self: PatientStorage, *args: Any, **kwargs: Any) -> Any:
        return patiently(name, lambda: method(self, *args, **kwargs), url=self.url_for_messages)

    return call


# every call that reads or writes the database, with the private ones Optuna's cache calls directly;
# the heartbeat and what touches no database are not
WAITED = sorted(
    {n for n in dir(optuna.storages.BaseStorage) if not n.startswith("_")}
    - {"remove_session", "check_trial_is_updatable"}
    | {"_get_stale_trial_ids", "_get_trials", "_create_new_trial", "_get_best_trial_id", "_set_trial_param"}
)
for _name in WAITED:
    setattr(PatientStorage, _name, _patient(_name))
