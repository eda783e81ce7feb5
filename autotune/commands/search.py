"""``autotune search`` and ``autotune resume``: every check before anything is written, the
search, and the lines it ends with (rendered from the :class:`SearchResult`)."""

from __future__ import annotations

from pathlib import Path

from autotune.commands.inputs import context_for
from autotune.commands.opening import ROOM_FOR_SEARCH, ROOM_FOR_STUDY, saved_recipe
from autotune.errors import UsageError
from autotune.progress import make_reporter, short_params
from autotune.recipe import Recipe
from autotune.search.loop import Search, SearchResult
from autotune.study import StudyPaths, check_database, check_storage, plain_failures, prepare_root


def start_search(recipe: Recipe, runs_dir: Path) -> None:
    paths = StudyPaths(runs_dir, recipe.name)
    if paths.recipe.exists():
        saved = Recipe.load(paths.recipe)
        diff = saved.differences(recipe)
        if diff:
            raise UsageError(
                f"study '{recipe.name}' already exists with a different recipe ({', '.join(diff)} "
                f"differ): run `autotune resume {recipe.name}` to continue it, or choose a new --name"
            )
    check_database(paths, recipe)
    check_storage(paths, recipe)  # a shared study: reachable, and started with this recipe
    search = prepare_search(recipe, paths)  # every check first: a typo must not claim the name
    with plain_failures(paths, recipe, ROOM_FOR_SEARCH):
        prepare_root(paths)
        recipe.save(paths.recipe)
        run(search, recipe, paths)


def resume_search(
    name: str, runs_dir: Path, *, trials: int | None = None, time_budget_s: float | None = None
) -> None:
    paths = StudyPaths(runs_dir, name)
    known = sorted(p.parent.name for p in runs_dir.glob("*/recipe.yaml")) if runs_dir.exists() else []
    hint = f"; studies here: {', '.join(known)}" if known else ""
    recipe = saved_recipe(paths, f"{hint} (start one with autotune search)")
    check_database(paths, recipe)
    if trials is not None:
        if trials < 1:
            raise UsageError("--trials must be at least 1")
        recipe.trials = trials
    if time_budget_s is not None:
        recipe.time_budget_s = time_budget_s
    check_storage(paths, recipe)
    search = prepare_search(recipe, paths)
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        prepare_root(paths)
        recipe.save(paths.recipe)
        run(search, recipe, paths)


def prepare_search(recipe: Recipe, paths: StudyPaths) -> Search:
    """The search with every check done (space, pins, the runner's program and rules) and
    nothing written yet."""
    if recipe.runner == "sim" and recipe.image_tokens:
        # the simulator's trainer has no image tokens: the planner would count images no trial carries
        raise UsageError(
            f"--image-tokens {recipe.image_tokens} with --runner sim: the simulator runs text-only "
            "trials; use autotune estimate for a vision what-if, or --runner trl"
        )
    return Search(recipe, paths, context_for(recipe), make_reporter(recipe.trials))


def run(search: Search, recipe: Recipe, paths: StudyPaths) -> None:
    """Run the search (its live display closed however it ends), then print how it ended."""
    try:
        result = search.run()
    finally:
        search.reporter.close()
    finish_lines(recipe, paths, result)


def finish_lines(recipe: Recipe, paths: StudyPaths, result: SearchResult) -> None:
    """The best configuration (and its confirmation), where its launch files are, why it stopped."""
    best = result.best
    if best is None:
        print(
            f"nothing to export after {result.launched} trial(s): none ran and kept the headroom "
            f"through its checks; see autotune show {paths.name} (runs dir {paths.runs_dir})"
        )
        if result.stopped_reason:
            print(result.stopped_reason)
        return
    peak = (
        f", peak {best.peak_memory_gib:.1f}/{recipe.gpu_memory_gib:.1f} GiB"
        if best.peak_memory_gib
        else ", peak not measured"
    )
    print(f"best: trial {best.number}: {best.throughput:.4g} completions/s{peak}")
    c = result.confirmation
    if c is not None and c.held and c.throughput:
        cpeak = f", peak {c.peak_memory_gib:.1f} GiB" if c.peak_memory_gib else ""
        print(f"      confirmed over {c.steps} steps: {c.throughput:.4g} completions/s{cpeak}")
    print(f"      {short_params(best.params)}")
    names = ", ".join(p.name for p in result.exported) or "nothing"
    print(f"launch configs: {paths.best}/ ({names})")
    if result.stopped_reason:
        print(result.stopped_reason)
