"""Is the study folder what it claims to be, and can its database be read? One line when not.

A damaged study must never be misread. A missing or empty SQLite file next to trial folders is not
a new study: opening it would create a fresh database and start a search over the old trials/ and
best/, so it is refused before anything is opened (SQLite creates the file on connect). A file
SQLite cannot read is called damaged, with how to salvage it; it is never deleted or rewritten.
A folder renamed or copied holds a database whose study has the old name: opening it under the new
name would start a second study in the same file and write over trials/ and best/, so that is
refused too (:func:`check_folder`).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import optuna

from autotune.errors import SQLITE_FULL, UsageError, causes, disk_full, no_space
from autotune.recipe import Recipe
from autotune.study.paths import StudyPaths

log = logging.getLogger(__name__)

# what sqlite3 says when the file's pages are not a database (any more)
DAMAGED = (
    "database disk image is malformed",
    "file is not a database",
    "file is encrypted or is not a database",
    "malformed database schema",
)


def sqlite_file(url: str) -> Path | None:
    """The file behind a ``sqlite:///`` URL, or None for other databases and in-memory SQLite."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url[len(prefix) :] in ("", ":memory:"):
        return None
    return Path(url[len(prefix) :].split("?", 1)[0])


def held_trials(paths: StudyPaths) -> int:
    """How many trial folders the study folder holds (what a new database would be started over)."""
    trials = paths.root / "trials"
    return sum(1 for p in trials.iterdir() if p.name.isdigit()) if trials.is_dir() else 0


def check_database(paths: StudyPaths, recipe: Recipe, *, must_exist: bool = False) -> None:
    """Refuse a study whose SQLite file is missing or empty while it holds trials.

    With ``must_exist`` (show, export, verify) a study with no database at all is refused too,
    rather than created empty by opening it.
    """
    url = paths.storage_url(recipe)
    db = sqlite_file(url)
    if db is None:
        return
    if not db.exists():
        state = "missing"
    elif db.is_file() and db.stat().st_size == 0:
        state = "empty (0 bytes)"
    else:
        check_integrity(db, url)
        check_folder(paths, recipe, db)
        return
    held = held_trials(paths)
    best = paths.best.is_dir() and any(paths.best.iterdir())
    if held or best:
        what = f"{paths.root / 'trials'} holds {held} trials" if held else f"{paths.best} holds an export"
        raise UsageError(
            f"the study database {db} is {state} while {what}: restore {db.name} from a backup, "
            f"or start a new study with another --name (nothing was changed)"
        )
    if must_exist:
        raise UsageError(
            f"study '{paths.name}' has no trials yet: its database {db} is {state} "
            f"(run autotune resume {paths.name} to start it)"
        )


def check_integrity(db: Path, url: str) -> None:
    """Refuse a SQLite file with damaged pages before anything is written next to it.

    SQLite notices a bad page only when it reads it, which may be deep in a search, after the
    recipe was rewritten and trials were run; ``PRAGMA quick_check`` reads every page now, read-only
    (a study of thousands of trials takes well under a second). A file that cannot be checked for
    another reason (locked, unreadable) is left to Optuna, whose error is reported as it comes.
    """
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            found = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        damaged = damaged_error(exc, url)
        if damaged is not None:
            raise damaged from exc
        log.debug("could not check %s: %s", db, exc)
        return
    if found and found != ["ok"]:
        log.debug("integrity check of %s: %s", db, "; ".join(map(str, found)))
        raise _damaged_line(db, url, "database disk image is malformed")


def stored_names(db: Path) -> list[str]:
    """The studies a SQLite file holds, less the locks (``<study>:lock:<what>``), read-only."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            found = [row[0] for row in conn.execute("SELECT study_name FROM studies")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:  # no tables yet, locked: Optuna will say what it is
        log.debug("could not list the studies in %s: %s", db, exc)
        return []
    return sorted(n for n in found if ":lock:" not in n)


def check_folder(paths: StudyPaths, recipe: Recipe, db: Path) -> None:
    """Refuse a study folder whose database (or recipe) was made under another name.

    A renamed or copied folder still holds the study under its first name; opening it under the
    folder's name would create a second study in the same file, numbered from 0, whose trials write
    over trials/0, trials/1 ... and whose export over best/. The study's own record decides.
    """
    names = stored_names(db)
    recorded = names[0] if len(names) == 1 else None
    if names and paths.name not in names:
        recorded = recorded or ", ".join(names)
    elif recipe.name and recipe.name != paths.name and not names:
        recorded = recipe.name
    else:
        return
    raise UsageError(
        f"{paths.root} holds study '{recorded}', not '{paths.name}' (the folder was renamed or "
        f"copied): give it its name back (mv {paths.root} {paths.runs_dir / recorded.split(', ')[0]}), "
        "or use the copy from another --runs-dir under that name; nothing was changed"
    )


def _damaged_line(db: Path | None, url: str, what: str) -> UsageError:
    if db is None:
        return UsageError(
            f"the study storage {url} is damaged (sqlite: {what}): copy it aside and repair it, "
            f"or start a new study with another --name"
        )
    n = db.name
    return UsageError(
        f"the study database {db} is damaged (sqlite: {what}): copy it aside and salvage the copy "
        f"(in {db.parent}: cp {n} {n}.bak; sqlite3 {n}.bak .recover | sqlite3 {n}.new; "
        f"mv {n}.new {n}), or start a new study with another --name; nothing was deleted"
    )


def damaged_error(exc: BaseException, url: str) -> UsageError | None:
    """The one line for a database SQLite cannot read, or None when ``exc`` is something else."""
    for err in causes(exc):
        text = str(err)
        hit = next((m for m in DAMAGED if m in text), None)
        if hit is None:
            continue
        return _damaged_line(sqlite_file(url), url, hit)
    return None


def storage_error(url: str, exc: Exception, hint: str = "") -> UsageError:
    damaged = damaged_error(exc, url)
    if damaged is not None:
        return damaged
    full, _ = no_space(exc)
    if full:
        return disk_full(sqlite_file(url) or url, "use --runs-dir on a disk with room")
    if isinstance(exc, optuna.exceptions.StorageInternalError):
        return UsageError(f"cannot open storage {url}: {exc}".splitlines()[0])
    if isinstance(exc, (ImportError, ValueError)):
        return UsageError(f"cannot open storage {url}: {exc}".splitlines()[0])
    first = str(exc).splitlines()[0] if str(exc) else ""
    return UsageError(f"cannot open storage {url}: {exc.__class__.__name__}: {first}{hint}")


@contextmanager
def plain_failures(
    paths: StudyPaths, recipe: Recipe | None, fix: str, where: object | None = None
) -> Iterator[None]:
    """Turn a damaged database or a full disk met anywhere inside into one line, not a traceback.

    SQLite reports a bad page only when it reads that page, and a disk fills up at any write, so
    these come from deep inside a search or an export, wrapped by Optuna and SQLAlchemy. ``fix``
    says how to get past a full disk for this command; ``where`` names what was being written when
    the error does not (default: the file in the error, or the study's database or folder).
    """
    try:
        yield
    except click.ClickException:
        raise
    except Exception as exc:
        url = paths.storage_url(recipe) if recipe is not None else f"sqlite:///{paths.db}"
        damaged = damaged_error(exc, url)
        if damaged is not None:
            log.debug("damaged storage", exc_info=True)
            raise damaged from exc
        full, name = no_space(exc)
        if full:
            log.debug("disk full", exc_info=True)
            if where is None:
                where = paths.root
                if name and ".tmp" not in Path(name).name:
                    where = name
                elif any(SQLITE_FULL in str(e) for e in causes(exc)):
                    where = sqlite_file(url) or url
            raise disk_full(where, fix) from exc
        raise
