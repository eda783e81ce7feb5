"""Opening the Optuna study behind a search: SQLite in the study folder, or any RDB URL.

The sampler and pruner are the search's business and are handed in; the study only knows where
its trials are stored and turns every storage failure into one line the user can act on. What is
checked before anything is opened (a missing, empty, damaged or misnamed database) lives in
:mod:`autotune.study.checks`; waiting out a storage outage in :mod:`autotune.study.outage`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna

from autotune.errors import UsageError
from autotune.recipe import Recipe
from autotune.study.checks import check_database, sqlite_file, storage_error
from autotune.study.identity import identity_differences, identity_of
from autotune.study.outage import PatientStorage, creation_race, outage_limit_s
from autotune.study.paths import StudyPaths
from autotune.study.recovery import RetryInterrupted

log = logging.getLogger(__name__)

HEARTBEAT_S = 15  # how often a running trial says its controller is alive
GRACE_FACTOR = 4  # missed heartbeats before another controller takes the trial over
CREATION_TRIES = 10
SQLITE_BUSY_S = 10.0
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
        # several controllers and threads write one file: SQLite itself waits this long for a lock,
        # then a lock held longer is an outage, waited out with a line saying so (outage.py)
        engine["connect_args"] = {"timeout": min(SQLITE_BUSY_S, max(1.0, outage_limit_s()))}
    elif url.startswith("postgres"):
        engine["connect_args"] = {"connect_timeout": 10}
        engine["pool_pre_ping"] = True
    kwargs: dict[str, Any] = {}
    if heartbeat:
        interval = heartbeat_s()
        kwargs = dict(
            heartbeat_interval=interval,
            grace_period=GRACE_FACTOR * interval,
            heartbeat_stale_trial_callback=RetryInterrupted(paths),
        )
    for attempt in range(CREATION_TRIES):
        try:
            storage = PatientStorage(url, engine_kwargs=engine, **kwargs)
            break
        except Exception as exc:  # two controllers creating a new database's tables at one moment
            if attempt + 1 == CREATION_TRIES or not creation_race(exc):
                raise
            log.debug("the storage's tables were being created by another controller; again", exc_info=True)
            time.sleep(0.2 * (attempt + 1))
    storage.url_for_messages = redact(url)
    return storage


def _open_storage(paths: StudyPaths, recipe: Recipe, *, heartbeat: bool) -> optuna.storages.RDBStorage:
    url = paths.storage_url(recipe)
    real = driver_url(url)
    try:
        with warnings_quiet():
            return make_storage(real, heartbeat=heartbeat, paths=paths)
    except optuna.exceptions.StorageInternalError as exc:
        raise storage_error(url, exc) from None
    except Exception as exc:  # sqlalchemy errors: bad URL, server down, permissions
        if sqlite_file(url) is None and "connect" in str(exc).lower():
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            raise UsageError(
                f"cannot reach the study storage {redact(url)} ({first[:200]}): check the host, "
                f"port, user and database, and that the server runs"
            ) from None
        raise storage_error(redact(url), exc, " (check --storage)") from None


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
        raise storage_error(redact(recipe.storage), exc, " (check --storage)") from None
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
        raise storage_error(url, exc) from None
    except Exception as exc:  # sqlalchemy errors: bad URL, server down, permissions
        raise storage_error(redact(url), exc, " (check --storage)") from None
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
        raise storage_error(redact(url), exc, " (check --storage)") from None
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
        raise storage_error(redact(url), exc) from None
