"""Opening the Optuna study behind a search: SQLite in the study folder, or any RDB URL.

The sampler and pruner are the search's business and are handed in; the study only knows where
its trials are stored and turns every storage failure into one line the user can act on.
"""

from __future__ import annotations

from typing import Any

import optuna

from autotune.errors import UsageError
from autotune.recipe import Recipe
from autotune.study.paths import StudyPaths


def _storage_error(url: str, exc: Exception, hint: str = "") -> UsageError:
    if isinstance(exc, (ImportError, ValueError)):
        return UsageError(f"cannot open storage {url}: {exc}".splitlines()[0])
    first = str(exc).splitlines()[0] if str(exc) else ""
    return UsageError(f"cannot open storage {url}: {exc.__class__.__name__}: {first}{hint}")


def open_study(paths: StudyPaths, recipe: Recipe, *, sampler: optuna.samplers.BaseSampler | None = None,
               pruner: optuna.pruners.BasePruner | None = None, storage: Any = None) -> optuna.Study:
    """Create or load the study. ``storage`` may be a storage object (the benchmark passes an
    in-memory one); otherwise the recipe's URL or the study folder's SQLite file."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = paths.storage_url(recipe)
    try:
        return optuna.create_study(study_name=paths.name, storage=storage or url, direction="maximize",
                                   sampler=sampler, pruner=pruner, load_if_exists=True)
    except optuna.exceptions.StorageInternalError as exc:
        raise UsageError(f"cannot open storage {url}: {exc}".splitlines()[0])
    except Exception as exc:  # sqlalchemy errors: bad URL, server down, permissions
        raise _storage_error(url, exc, " (check --storage)")


def load_existing(paths: StudyPaths, recipe: Recipe) -> optuna.Study:
    """Load a study that must exist (show, export, verify)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = paths.storage_url(recipe)
    try:
        return optuna.load_study(study_name=paths.name, storage=url)
    except KeyError:
        raise UsageError(f"study '{paths.name}' has no trials in {url} yet")
    except Exception as exc:  # sqlalchemy errors: server down, permissions, a damaged file
        raise _storage_error(url, exc)
