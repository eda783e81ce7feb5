"""A lock held through the study's own storage, so controllers on several machines can agree.

Controllers that share a study share nothing but its storage (SQLite on one machine, PostgreSQL
across machines), so the lock lives there: it is a second Optuna study named ``<study>:lock:<what>``.
Creating a study with a taken name fails atomically in every storage Optuna has (a unique key in the
RDB schema), which is all a lock needs; releasing it deletes that study. The holder refreshes a
timestamp in it while it holds it, so a lock whose holder was killed is broken once it has not been
refreshed for ``stale_s`` seconds, instead of blocking the study forever.

Each taking of the lock carries a random token. SQLite reuses the id of a deleted study, so a
holder that stalled while its lock was broken and taken again by another controller would find the
newcomer's lock under its own old id: it releases (and refreshes) only a lock carrying its token.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from types import TracebackType
from typing import Any

import optuna
from optuna.study import StudyDirection

from autotune.errors import UsageError

log = logging.getLogger(__name__)

STALE_S = 60.0  # a lock not refreshed for this long belongs to a dead controller
REFRESH_S = 5.0  # how often a holder says it is alive
WAIT_S = 300.0  # how long a lock may sit unchanged (never refreshed, never broken) before giving up

# lock studies seen without their "at" (a holder killed between creating and stamping them), by
# (name, id): when this process first saw each, so such a lock too goes stale after ``stale_s``
_FIRST_SEEN: dict[tuple[str, int], float] = {}


def holder_name() -> str:
    """Who holds a lock, in words a person can find: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


class StudyLock:
    """``with StudyLock(storage, study, "finish"):`` -- one controller at a time, across machines."""

    def __init__(
        self,
        storage: optuna.storages.BaseStorage,
        study_name: str,
        what: str,
        *,
        stale_s: float = STALE_S,
        poll_s: float = 0.2,
        wait_s: float = WAIT_S,
    ) -> None:
        self.storage, self.name = storage, f"{study_name}:lock:{what}"
        self.stale_s, self.poll_s, self.wait_s = stale_s, poll_s, wait_s
        self.lock_id: int | None = None
        self.token = ""
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free (or stale); never waits.

        A lock whose stamp cannot be written (a storage blip) is deleted again before the error
        goes on: left unstamped it would block every other controller until it is seen as stale."""
        try:
            lock_id = self.storage.create_new_study([StudyDirection.MAXIMIZE], self.name)
        except optuna.exceptions.DuplicatedStudyError:
            self._break_if_stale()
            return False
        self.lock_id, self.token = lock_id, secrets.token_hex(8)
        try:
            self._touch()
        except BaseException:
            self._delete(lock_id)
            self.lock_id, self.token = None, ""
            raise
        self._stop.clear()
        self._refresher = threading.Thread(target=self._refresh, name=f"lock {self.name}", daemon=True)
        self._refresher.start()
        return True

    def acquire(self, timeout_s: float | None = None) -> bool:
        """Wait for the lock. A holder that keeps refreshing it is waited for as long as it holds it
        (the finish lock is held through the confirmation runs); a lock that stays unchanged for
        ``timeout_s`` (default ``wait_s``) without being broken is one line naming it and its holder,
        instead of a silent wait forever (a clock far ahead on the holder's machine, a storage that
        refuses the delete)."""
        limit = self.wait_s if timeout_s is None else timeout_s
        seen: Any = None
        since = time.monotonic()
        while not self.try_acquire():
            now_seen = self._peek()
            if now_seen != seen:  # taken again, or refreshed: its holder is alive
                seen, since = now_seen, time.monotonic()
            elif time.monotonic() - since >= limit:
                holder = (now_seen or {}).get("holder") or "an unknown controller"
                raise UsageError(
                    f"the study lock '{self.name}' held by {holder} has not changed for "
                    f"{limit:.0f} s and could not be broken: if that controller is gone, "
                    f"delete the study '{self.name}' from the storage (optuna delete-study)"
                )
            time.sleep(self.poll_s)
        return True

    def release(self) -> None:
        if self.lock_id is None:
            return
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        if self._mine():
            self._delete(self.lock_id)
        else:
            log.warning("lock %s was broken by another controller while held", self.name)
        self.lock_id, self.token = None, ""

    def __enter__(self) -> StudyLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def _touch(self) -> None:
        assert self.lock_id is not None
        self.storage.set_study_user_attr(self.lock_id, "holder", holder_name())
        self.storage.set_study_user_attr(self.lock_id, "token", self.token)
        self.storage.set_study_user_attr(self.lock_id, "at", time.time())

    def _mine(self) -> bool:
        """Whether the study under our lock id is still our lock (not broken, not someone else's)."""
        try:
            return (
                self.lock_id is not None
                and self.storage.get_study_user_attrs(self.lock_id).get("token") == self.token
            )
        except KeyError:
            return False

    def _delete(self, lock_id: int) -> None:
        try:
            self.storage.delete_study(lock_id)
        except KeyError:
            pass
        except Exception as exc:  # the lock goes stale on its own; the original error matters more
            log.warning("could not delete lock %s: %s", self.name, exc)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                if not self._mine():  # broken and perhaps taken again: never stamp another's lock
                    log.warning("lock %s was broken by another controller while held", self.name)
                    return
                self.storage.set_study_user_attr(self.lock_id, "at", time.time())
            except Exception as exc:  # a storage hiccup: the next refresh tries again
                log.debug("could not refresh lock %s: %s", self.name, exc)

    def _peek(self) -> Any:
        """The current lock's id and attributes (what changes when it is refreshed or taken)."""
        try:
            lock_id = self.storage.get_study_id_from_name(self.name)
            return {"id": lock_id, **self.storage.get_study_user_attrs(lock_id)}
        except KeyError:
            return None
        except Exception as exc:  # a storage hiccup: the wait goes on
            log.debug("could not read lock %s: %s", self.name, exc)
            return None

    def _break_if_stale(self) -> None:
        """Delete the lock of a controller that died holding it (not refreshed for ``stale_s``).

        A lock with no stamp at all (its holder died between creating and stamping it) is stale
        ``stale_s`` after this process first saw it so. Clocks of different machines are compared
        here; ``stale_s`` is far above their usual skew."""
        try:
            lock_id = self.storage.get_study_id_from_name(self.name)
            attrs = self.storage.get_study_user_attrs(lock_id)
        except KeyError:
            return  # released meanwhile
        at = attrs.get("at")
        if at is None:
            first = _FIRST_SEEN.setdefault((self.name, lock_id), time.monotonic())
            age, since = time.monotonic() - first, "never stamped"
        else:
            _FIRST_SEEN.pop((self.name, lock_id), None)
            age, since = time.time() - float(at), "not refreshed"
        if age > self.stale_s:
            log.warning(
                "breaking the lock %s of %s: %s for %.0f s", self.name, attrs.get("holder", "?"), since, age
            )
            _FIRST_SEEN.pop((self.name, lock_id), None)
            self._delete(lock_id)
