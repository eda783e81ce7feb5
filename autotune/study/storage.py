"""Opening the Optuna study behind a search: SQLite in the study folder, or any RDB URL.

The sampler and pruner are the search's business and are handed in; the study only knows where
its trials are stored and turns every storage failure into one line the user can act on.

A damaged study must never be misread. A missing or empty SQLite file next to trial folders is not
a new study: opening it would create a fresh database and start a search over the old trials/ and
best/, so it is refused before anything is opened (SQLite creates the file on connect). A file
SQLite cannot read is called damaged, with how to salvage it; it is never deleted or rewritten.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import optuna

from autotune.errors import SQLITE_FULL, UsageError, causes, disk_full, no_space
from autotune.recipe import Recipe
from autotune.study.identity import identity_differences, identity_of
from autotune.study.paths import StudyPaths
from autotune.study.recovery import RetryInterrupted

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


def _storage_error(url: str, exc: Exception, hint: str = "") -> UsageError:
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


HEARTBEAT_S = 15  # how often a running trial says its controller is alive
GRACE_FACTOR = 4  # missed heartbeats before another controller takes the trial over
POSTGRES_EXTRA = "pip install 'autotune[postgres]'"
IDENTITY_ATTR = "recipe_identity"  # study user attribute: what every controller must agree on
RECIPE_ATTR = "recipe"  # the whole recipe and the space's text: another node can adopt the study
SPACE_ATTR = "space_yaml"


def heartbeat_s() -> int:
    """The heartbeat interval; ``AUTOTUNE_HEARTBEAT_S`` shortens it (the tests kill workers)."""
    try:
        return max(1, int(os.environ.get("AUTOTUNE_HEARTBEAT_S", HEARTBEAT_S)))
    except ValueError:
        return HEARTBEAT_S


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def driver_url(url: str) -> str:
    """The SQLAlchemy URL for ``--storage``: ``postgresql://`` goes through psycopg (3) when that is
    what is installed (SQLAlchemy's default driver for it is psycopg2); a missing driver is one line
    naming the extra that installs it."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.startswith(("postgresql", "postgres")):
        return url
    has = {name: importable(name) for name in ("psycopg", "psycopg2")}
    driver = scheme.partition("+")[2]
    if driver:
        if driver in has and not has[driver]:
            raise UsageError(
                f"--storage {redact(url)} needs the {driver} driver, which is not installed: "
                f"{POSTGRES_EXTRA} (and use postgresql+psycopg://)"
            )
        return url
    if has["psycopg"]:
        return f"postgresql+psycopg://{rest}"
    if has["psycopg2"]:
        return f"postgresql://{rest}"
    raise UsageError(
        f"--storage {redact(url)} needs a PostgreSQL driver, and none is installed: {POSTGRES_EXTRA}"
    )


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None and __import__(module) is not None
    except ImportError:
        return False


def make_storage(url: str, *, heartbeat: bool, paths: StudyPaths | None = None) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage; with ``heartbeat`` its running trials carry a heartbeat, and a trial whose
    controller died (no heartbeat for GRACE_FACTOR intervals) is failed and queued again by the next
    controller that looks (:class:`RetryInterrupted`, Optuna's RetryFailedTrialCallback for us)."""
    engine: dict[str, Any] = {}
    if url.startswith("sqlite"):
        engine["connect_args"] = {"timeout": 60}  # several controllers and threads write one file
    elif url.startswith("postgres"):
        engine["connect_args"] = {"connect_timeout": 10}
        engine["pool_pre_ping"] = True
    if not heartbeat:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine)
    interval = heartbeat_s()
    return optuna.storages.RDBStorage(
        url,
        engine_kwargs=engine,
        heartbeat_interval=interval,
        grace_period=GRACE_FACTOR * interval,
        heartbeat_stale_trial_callback=RetryInterrupted(paths),
    )


def _open_storage(paths: StudyPaths, recipe: Recipe, *, heartbeat: bool) -> optuna.storages.RDBStorage:
    url = paths.storage_url(recipe)
    real = driver_url(url)
    try:
        with warnings_quiet():
            return make_storage(real, heartbeat=heartbeat, paths=paths)
    except optuna.exceptions.StorageInternalError as exc:
        raise _storage_error(url, exc) from None
    except Exception as exc:  # sqlalchemy errors: bad URL, server down, permissions
        if sqlite_file(url) is None and "connect" in str(exc).lower():
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            raise UsageError(
                f"cannot reach the study storage {redact(url)} ({first[:200]}): check the host, "
                f"port, user and database, and that the server runs"
            ) from None
        raise _storage_error(redact(url), exc, " (check --storage)") from None


@contextmanager
def warnings_quiet() -> Iterator[None]:
    """Optuna marks the heartbeat arguments experimental; that warning is not the user's business."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def check_identity(study: optuna.Study, recipe: Recipe, url: str) -> None:
    """Refuse a controller whose recipe differs from the one the study was started with.

    recipe.yaml guards this on one machine; a node joining a shared study may have no recipe.yaml,
    so the study itself keeps what it was started with."""
    mine = identity_of(recipe)
    theirs = study.user_attrs.get(IDENTITY_ATTR)
    if theirs is None:
        study.set_user_attr(IDENTITY_ATTR, mine)
        study.set_user_attr(RECIPE_ATTR, recipe.to_dict())
        space = Path(recipe.space) if recipe.space else None
        if space is not None and space.is_file():
            study.set_user_attr(SPACE_ATTR, space.read_text())
        return
    differ = identity_differences(mine, theirs)
    if differ:
        raise UsageError(
            f"study '{study.study_name}' in {redact(url)} was started with a different recipe "
            f"({', '.join(differ)} differ): use the same flags as the other controllers, "
            "or choose a new --name"
        )


def check_storage(paths: StudyPaths, recipe: Recipe) -> None:
    """Before anything is written: a ``--storage`` server must be reachable with an installed driver,
    and a study of that name there must have been started with the same recipe."""
    if not recipe.storage or sqlite_file(recipe.storage) is not None:
        return
    storage = _open_storage(paths, recipe, heartbeat=False)
    try:
        study_id = storage.get_study_id_from_name(paths.name)
    except KeyError:
        return
    except Exception as exc:
        raise _storage_error(redact(recipe.storage), exc, " (check --storage)") from None
    theirs = storage.get_study_user_attrs(study_id).get(IDENTITY_ATTR)
    differ = identity_differences(identity_of(recipe), theirs or {})
    if differ:
        raise UsageError(
            f"study '{paths.name}' in {redact(recipe.storage)} was started with a different recipe "
            f"({', '.join(differ)} differ): use the same flags as the other controllers, "
            "or choose a new --name"
        )


def open_study(
    paths: StudyPaths,
    recipe: Recipe,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    storage: Any = None,
) -> optuna.Study:
    """Create or load the study. ``storage`` may be a storage object (the benchmark passes an
    in-memory one); otherwise the recipe's URL or the study folder's SQLite file, opened with
    heartbeats so that several controllers can share it (docs/cluster.md)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = paths.storage_url(recipe)
    if storage is None:
        check_database(paths, recipe)
        storage = _open_storage(paths, recipe, heartbeat=True)
    try:
        study = optuna.create_study(
            study_name=paths.name,
            storage=storage,
            direction="maximize",
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
    except optuna.exceptions.StorageInternalError as exc:
        raise _storage_error(url, exc) from None
    except Exception as exc:  # sqlalchemy errors: bad URL, server down, permissions
        raise _storage_error(redact(url), exc, " (check --storage)") from None
    check_identity(study, recipe, url)
    return study


def adopt_shared_study(paths: StudyPaths, url: str) -> None:
    """Write this node's ``runs/<study>/recipe.yaml`` (and the space file, when its path does not
    hold the same space here) from a shared study, so that ``resume``, ``show`` and ``export`` work
    on a node that never ran the search. Does nothing when the recipe is already here."""
    if paths.recipe.exists():
        return
    probe = Recipe(model="", gpus=1, storage=url)
    storage = _open_storage(paths, probe, heartbeat=False)
    try:
        attrs = storage.get_study_user_attrs(storage.get_study_id_from_name(paths.name))
    except KeyError:
        raise UsageError(
            f"no study '{paths.name}' in {redact(url)}: check --storage and the study name"
        ) from None
    except Exception as exc:
        raise _storage_error(redact(url), exc, " (check --storage)") from None
    data = attrs.get(RECIPE_ATTR)
    if not isinstance(data, dict):
        raise UsageError(
            f"study '{paths.name}' in {redact(url)} does not hold its recipe (an older autotune "
            f"started it): copy {paths.recipe} from a node that ran the search"
        )
    recipe = Recipe.from_dict(data)
    recipe.storage = url
    text = attrs.get(SPACE_ATTR)
    if text is not None and not (
        recipe.space and Path(recipe.space).is_file() and Path(recipe.space).read_text() == text
    ):
        paths.root.mkdir(parents=True, exist_ok=True)
        local = paths.root / "space.yaml"
        local.write_text(text)
        recipe.space = str(local.resolve())
    paths.root.mkdir(parents=True, exist_ok=True)
    recipe.save(paths.recipe)


def load_existing(paths: StudyPaths, recipe: Recipe) -> optuna.Study:
    """Load a study that must exist (show, export, verify)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = paths.storage_url(recipe)
    check_database(paths, recipe, must_exist=True)
    storage = _open_storage(paths, recipe, heartbeat=False)
    try:
        return optuna.load_study(study_name=paths.name, storage=storage)
    except KeyError:
        raise UsageError(f"study '{paths.name}' has no trials in {redact(url)} yet") from None
    except Exception as exc:  # sqlalchemy errors: server down, permissions, a damaged file
        raise _storage_error(redact(url), exc) from None
