"""A study folder opened by name: its recipe, its storage; a folder that lost a part is named."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autotune.errors import UsageError
from autotune.recipe import Recipe
from autotune.study import StudyPaths, held_trials, load_existing, plain_failures

if TYPE_CHECKING:
    import optuna

ROOM_FOR_SEARCH = "use --runs-dir on a disk with room"
ROOM_FOR_STUDY = "copy the study folder to a disk with room and use --runs-dir there"


def saved_recipe(paths: StudyPaths, hint: str) -> Recipe:
    """The study's recipe.yaml. A folder that holds a study but lost its recipe is told apart
    from no study at all: the fix differs (restore the file, not start a search)."""
    if paths.recipe.exists():
        return Recipe.load(paths.recipe)
    held = held_trials(paths)
    there = [
        name
        for name, present in (
            ("study.db", paths.db.exists()),
            (f"{held} trials", held > 0),
            ("best/", paths.best.is_dir()),
        )
        if present
    ]
    if there:
        raise UsageError(
            f"study '{paths.name}' in {paths.runs_dir} has {', '.join(there)} but its recipe.yaml "
            f"is missing: restore {paths.recipe} from a backup, or run autotune search with the "
            f"study's original flags and --name {paths.name} to write it again"
        )
    raise UsageError(f"no study '{paths.name}' in {paths.runs_dir}{hint}")


def open_named(name: str, runs_dir: Path) -> tuple[StudyPaths, Recipe, optuna.Study]:
    """The study ``name`` in ``runs_dir``: its paths, its saved recipe and its Optuna study."""
    paths = StudyPaths(runs_dir, name)
    recipe = saved_recipe(paths, f" (list them with ls {runs_dir})")
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        return paths, recipe, load_existing(paths, recipe)
