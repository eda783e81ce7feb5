"""The study lock (study/lock.py): a lock that can be broken when its holder died, only by itself
released, and never waited on silently forever."""

from __future__ import annotations

import threading
import time

import optuna
import pytest
from optuna.study import StudyDirection


@pytest.fixture
def storage(tmp_path):
    """A SQLite storage holding one study, as a search's: SQLite reuses the ids of deleted studies."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    store.create_new_study([StudyDirection.MAXIMIZE], "s")
    return store


def test_a_lock_never_stamped_goes_stale(storage):
    """A holder killed between creating the lock and stamping it leaves a lock with no "at": it is
    broken ``stale_s`` after it was first seen, not waited on forever."""
    from autotune.study.lock import StudyLock

    storage.create_new_study([StudyDirection.MAXIMIZE], "s:lock:claim")  # the dead holder's, no stamp
    lock = StudyLock(storage, "s", "claim", stale_s=0.5, poll_s=0.05)
    started = time.monotonic()
    assert lock.acquire(timeout_s=3) is True
    assert time.monotonic() - started < 2.5
    lock.release()


def test_a_stamp_that_fails_leaves_no_lock(storage, monkeypatch):
    """A storage blip while stamping the new lock: the error goes on, and the unstamped lock is gone
    (it would block every other controller)."""
    from autotune.study.lock import StudyLock

    real = storage.set_study_user_attr

    def flaky(study_id, key, value):
        if key == "at":
            raise optuna.exceptions.StorageInternalError("database is locked")
        real(study_id, key, value)

    monkeypatch.setattr(storage, "set_study_user_attr", flaky)
    with pytest.raises(optuna.exceptions.StorageInternalError):
        StudyLock(storage, "s", "claim").try_acquire()
    with pytest.raises(KeyError):
        storage.get_study_id_from_name("s:lock:claim")
    monkeypatch.setattr(storage, "set_study_user_attr", real)
    again = StudyLock(storage, "s", "claim")
    assert again.try_acquire()
    again.release()


def test_a_stalled_holder_does_not_release_the_next_holders_lock(storage):
    """A stalls, its lock is broken and B takes it under the same id (SQLite reuses it): A's release
    leaves B's lock alone."""
    from autotune.study.lock import StudyLock

    a, b = StudyLock(storage, "s", "finish"), StudyLock(storage, "s", "finish")
    assert a.try_acquire()
    storage.delete_study(a.lock_id)  # broken as stale by a third controller
    assert b.try_acquire()
    assert b.lock_id == a.lock_id, "precondition: SQLite gave B's lock A's old id"
    a.release()
    assert storage.get_study_id_from_name("s:lock:finish") == b.lock_id, "A deleted B's lock"
    b.release()
    with pytest.raises(KeyError):
        storage.get_study_id_from_name("s:lock:finish")


def test_a_lock_that_never_changes_is_one_line(storage):
    """A lock that is neither refreshed nor breakable (its holder's clock an hour ahead) ends the wait
    with one line naming the lock and its holder."""
    from autotune.errors import UsageError
    from autotune.study.lock import StudyLock

    lock_id = storage.create_new_study([StudyDirection.MAXIMIZE], "s:lock:claim")
    storage.set_study_user_attr(lock_id, "holder", "node-7:4242")
    storage.set_study_user_attr(lock_id, "at", time.time() + 3600)
    with pytest.raises(UsageError) as caught:
        with StudyLock(storage, "s", "claim", wait_s=1, poll_s=0.05):
            pass
    line = caught.value.format_message()
    assert "\n" not in line and "s:lock:claim" in line and "node-7:4242" in line, line


def test_a_refreshing_holder_is_waited_for_past_the_timeout(storage, monkeypatch):
    """The finish lock is held through the confirmation runs: a holder that keeps refreshing it is
    waited for however long it holds it; the timeout is for a lock that never changes."""
    from autotune.study import lock as lock_module
    from autotune.study.lock import StudyLock

    monkeypatch.setattr(lock_module, "REFRESH_S", 0.1)
    holder = StudyLock(storage, "s", "finish")
    assert holder.try_acquire()
    threading.Timer(2.0, holder.release).start()
    started = time.monotonic()
    with StudyLock(storage, "s", "finish", wait_s=0.7, poll_s=0.05):
        assert time.monotonic() - started >= 1.5
