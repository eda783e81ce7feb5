"""A lock held through the study's own storage, so controllers on several machines can agree.

Controllers that share a study share nothing but its storage (SQLite on one machine, PostgreSQL
across machines), so the lock lives there: it is a second Optuna study named ``<study>:lock:<what>``.
Creating a study with a taken name fails atomically in every storage Optuna has (a unique key in the
RDB schema), which is all a lock needs; releasing it deletes that study. The holder refreshes a
timestamp in it while it holds it, so a lock whose holder was killed is broken once it has not been
refreshed for ``stale_s`` seconds, instead of blocking the study forever.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from types import TracebackType

import optuna
from optuna.study import StudyDirection

log = logging.getLogger(__name__)

STALE_S = 60.0        # a lock not refreshed for this long belongs to a dead controller
REFRESH_S = 5.0       # how often a holder says it is alive


def holder_name() -> str:
    """Who holds a lock, in words a person can find: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


class StudyLock:
    """``with StudyLock(storage, study, "finish"):`` -- one controller at a time, across machines."""

    def __init__(self, storage: optuna.storages.BaseStorage, study_name: str, what: str, *,
                 stale_s: float = STALE_S, poll_s: float = 0.2) -> None:
        self.storage, self.name = storage, f"{study_name}:lock:{what}"
        self.stale_s, self.poll_s = stale_s, poll_s
        self.lock_id: int | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free (or stale); never waits."""
        try:
            self.lock_id = self.storage.create_new_study([StudyDirection.MAXIMIZE], self.name)
        except optuna.exceptions.DuplicatedStudyError:
            self._break_if_stale()
            return False
        self._touch()
        self._stop.clear()
        self._refresher = threading.Thread(target=self._refresh, name=f"lock {self.name}", daemon=True)
        self._refresher.start()
        return True

    def acquire(self, timeout_s: float | None = None) -> bool:
        """Wait for the lock, up to ``timeout_s`` (None: as long as it takes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.try_acquire():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)
        return True

    def release(self) -> None:
        if self.lock_id is None:
            return
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        try:
            self.storage.delete_study(self.lock_id)
        except KeyError:
            log.warning("lock %s was broken by another controller while held", self.name)
        self.lock_id = None

    def __enter__(self) -> "StudyLock":
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def _touch(self) -> None:
        assert self.lock_id is not None
        self.storage.set_study_user_attr(self.lock_id, "holder", holder_name())
        self.storage.set_study_user_attr(self.lock_id, "at", time.time())

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self._touch()
            except Exception as exc:   # a storage hiccup: the next refresh tries again
                log.debug("could not refresh lock %s: %s", self.name, exc)

    def _break_if_stale(self) -> None:
        """Delete the lock of a controller that died holding it (not refreshed for ``stale_s``).

        Clocks of different machines are compared here; ``stale_s`` is far above their usual skew."""
        try:
            lock_id = self.storage.get_study_id_from_name(self.name)
            attrs = self.storage.get_study_user_attrs(lock_id)
        except KeyError:
            return                      # released meanwhile
        at = attrs.get("at")
        if at is None:
            return                      # being created right now: its holder writes "at" next
        if time.time() - float(at) > self.stale_s:
            log.warning("breaking the lock %s of %s: not refreshed for %.0f s", self.name,
                        attrs.get("holder", "?"), time.time() - float(at))
            try:
                self.storage.delete_study(lock_id)
            except KeyError:
                pass
