"""What each CLI command does, as importable functions (the CLI only parses flags).

``search`` resolves the recipe's inputs (model, hardware, space, pins), opens or creates the
study folder and hands over to the search loop; ``resume`` rebuilds the same from recipe.yaml;
``show``, ``export``, ``verify`` and ``estimate`` read the study or the memory model.

A study folder that lost a part (recipe.yaml, study.db) is named as such and refused before
anything is written, and a damaged database or a full disk met while a command runs ends it with
one line (:func:`autotune.study.storage.plain_failures`), never a traceback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError
from autotune.export import export_study
from autotune.export.layout import PARAMS_JSON
from autotune.hardware import resolve_hardware, visible_gpus
from autotune.models import resolve_model
from autotune.progress import make_reporter, short_params
from autotune.recipe import Recipe
from autotune.runners import TrialContext, make_runner
from autotune.search.loop import Search
from autotune.study import (
    StudyPaths,
    check_database,
    check_storage,
    held_trials,
    load_existing,
    plain_failures,
    prepare_root,
    rank,
    rows,
)
from autotune.study.ranking import choose_best, confirmations, eligible, headroom_limit
from autotune.trial.control import StopRule, TrialControl
from autotune.trial.layout import TrialFiles
from autotune.units import GIB

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

VERIFY_NUMBER_OFFSET = 200_000  # verify runs are numbered apart from search trials and confirmations
ROOM_FOR_SEARCH = "use --runs-dir on a disk with room"
ROOM_FOR_STUDY = "copy the study folder to a disk with room and use --runs-dir there"


def resolve_inputs(
    recipe: Recipe,
    gpu_type: str | None,
    gpu_memory: float | None,
    space_path: Path | None,
    raw_pins: dict[str, str],
) -> None:
    """Check model, hardware, space and pins, filling the recipe's resolved fields."""
    if int(recipe.image_tokens or 0) < 0:
        raise UsageError(
            f"--image-tokens {recipe.image_tokens}: tokens per image cannot be negative "
            "(0: text-only prompts)"
        )
    if int(recipe.images_per_prompt) < 1:
        raise UsageError(
            f"--images-per-prompt {recipe.images_per_prompt} must be at least 1 "
            "(text-only prompts: leave --image-tokens at 0)"
        )
    resolve_model(recipe.model)
    if recipe.device == "cpu" and recipe.runner != "sim":
        # CPU trials: the "device memory" is the per-trial cap, or the host's RAM
        import psutil

        if recipe.gpus < 1:
            raise UsageError("--gpus must be at least 1 (with --device cpu: the number of processes)")
        recipe.gpu_type = "CPU"
        recipe.gpu_memory_gib = float(
            recipe.memory_limit_gib or round(psutil.virtual_memory().total / GIB, 1)
        )
    else:
        real = recipe.runner in ("trl", "swift")
        need_visible = recipe.runner == "command" or (real and recipe.device == "cuda")
        if real and not visible_gpus():
            trainer = "TRL" if recipe.runner == "trl" else "ms-swift"
            raise UsageError(
                f"no GPU is visible for real {trainer} trials: use --device cpu for a CPU rehearsal "
                "with real trials, or --runner sim --gpu-type TYPE to simulate GPUs"
            )
        gpu = resolve_hardware(recipe.gpus, gpu_type, gpu_memory, need_visible=need_visible)
        recipe.gpu_type, recipe.gpu_memory_gib = gpu.name, gpu.memory_gib
    if space_path is None and recipe.runner == "swift":
        from autotune.configs import swift_space_path  # ms-swift's own knobs beside the shared ones

        space_path = swift_space_path()
    space = load_space(space_path)
    recipe.space, recipe.space_digest = str(space.path), space.digest
    if recipe.dataset:
        dataset = Path(recipe.dataset).expanduser()
        if not dataset.is_file():
            raise UsageError(
                f"--dataset {recipe.dataset}: no such file (give a JSONL file with a 'prompt' field)"
            )
        recipe.dataset = str(dataset.resolve())  # trials run in their own folders
    constraints.pin(recipe, space, raw_pins)


def context_for(recipe: Recipe) -> TrialContext:
    from dataclasses import replace

    from autotune.hardware import find_gpu_type, unlisted_gpu

    try:
        gpu = replace(find_gpu_type(recipe.gpu_type), memory_gib=recipe.gpu_memory_gib)
    except UsageError:
        gpu = unlisted_gpu(recipe.gpu_type, recipe.gpu_memory_gib)
    space = load_space(recipe.space or None)
    return TrialContext(recipe=recipe, space=space, model=resolve_model(recipe.model), gpu=gpu)


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
    try:
        result = search.run()
    finally:
        search.reporter.close()
    finish_lines(recipe, paths, result)


def finish_lines(recipe: Recipe, paths: StudyPaths, result) -> None:
    best = result.best
    if best is None:
        print(
            f"no configuration ran successfully in {result.launched} trial(s); see "
            f"autotune show {paths.name} (runs dir {paths.runs_dir})"
        )
        if result.stopped_reason:
            print(result.stopped_reason)
        return
    peak = (
        f", peak {best.peak_memory_gib:.1f}/{recipe.gpu_memory_gib:.1f} GiB" if best.peak_memory_gib else ""
    )
    print(f"best: trial {best.number}: {best.throughput:.4g} completions/s{peak}")
    if result.confirmation is not None and result.confirmation.get("throughput"):
        c = result.confirmation
        cpeak = f", peak {c['peak_memory_gib']:.1f} GiB" if c.get("peak_memory_gib") else ""
        print(f"      confirmed over {c.get('steps')} steps: {c['throughput']:.4g} completions/s{cpeak}")
    print(f"      {short_params(best.params)}")
    names = ", ".join(p.name for p in result.exported) or "nothing"
    print(f"launch configs: {paths.best}/ ({names})")
    if result.stopped_reason:
        print(result.stopped_reason)


def open_named(name: str, runs_dir: Path):
    paths = StudyPaths(runs_dir, name)
    recipe = saved_recipe(paths, f" (list them with ls {runs_dir})")
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        return paths, recipe, load_existing(paths, recipe)


def show_study(name: str, runs_dir: Path, as_json: bool) -> None:
    paths, recipe, study = open_named(name, runs_dir)
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        _show(name, recipe, study, as_json)


def _show(name: str, recipe: Recipe, study: optuna.Study, as_json: bool) -> None:
    """The table (or JSON) of trials, best first; may read pages of the database no open touched."""
    all_rows = rows(study)
    ranked = rank(all_rows)
    done = confirmations(study)
    best, _ = choose_best(all_rows, recipe, done)
    passed: dict[int, str] = {}
    eligible(all_rows, recipe, done, passed_over=passed)

    def verdict(r) -> str:
        """What the export made of this trial: chosen, passed over (why), confirmed, or nothing."""
        if best is not None and r.number == best.number:
            return "exported"
        if r.number in passed:
            return "passed over: " + passed[r.number]
        c = done.get(r.number)
        return f"confirmed {c['throughput']:.4g}/s" if c and c.get("throughput") else ""

    if as_json:
        print(json.dumps([{**r.__dict__, "verdict": verdict(r)} for r in ranked], indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    launched = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("launched"))
    table = Table(
        title=f"{name}: {launched} launched of {recipe.trials} "
        f"({recipe.model}, {recipe.gpus}x{recipe.gpu_type})"
    )
    for col in ("trial", "status", "completions/s", "peak GiB", "predicted", "verdict", "params / reason"):
        table.add_column(col)
    predicted = {t.number: t.user_attrs.get("predicted_gib") for t in study.get_trials(deepcopy=False)}
    for r in ranked:
        status = f"oom/{r.oom_kind}" if r.status == "oom" else r.status
        if not r.launched and r.status not in ("invalid", "skipped"):
            status += " (repeat)"
        tail = (
            short_params(r.params)
            if r.status in ("ok", "oom")
            else (r.error_line or r.reason or short_params(r.params))
        )
        if r.status == "ok" and r.diagnosis:  # the low-utilization diagnosis, where people look
            tail += f"; {r.diagnosis}"
        pred = predicted.get(r.number)
        table.add_row(
            str(r.number),
            status,
            f"{r.throughput:.4g}" if r.throughput else "-",
            f"{r.peak_memory_gib:.1f}" if r.peak_memory_gib else "-",
            f"{pred:.1f}" if pred else "-",
            verdict(r)[:70],
            tail[:200],
        )
    console = Console(width=200)
    console.print(table)
    errors = [
        abs(predicted[r.number] - r.peak_memory_gib) / r.peak_memory_gib
        for r in ranked
        if r.launched and r.status == "ok" and r.peak_memory_gib and predicted.get(r.number)
    ]
    if errors:
        console.print(
            f"memory model: mean error {sum(errors) / len(errors):.1%} over {len(errors)} trials "
            "that ran ok (each predicted before its trial ran, with what was known then)"
        )


def export_named(name: str, runs_dir: Path, out: Path | None) -> list[Path]:
    paths, recipe, study = open_named(name, runs_dir)
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: give a folder (it keeps whatever else it holds)")
    target = out or paths.best
    with plain_failures(paths, recipe, "export elsewhere with --out DIR", where=target):
        written = export_study(study, recipe, target)
    if not written:
        raise UsageError(f"study '{name}' has no successful trial yet: nothing to export")
    return written


def report_named(name: str, runs_dir: Path, out: Path | None) -> Path:
    from autotune.export.report import write_report

    paths, recipe, study = open_named(name, runs_dir)
    if out is not None and out.is_dir():
        raise UsageError(f"--out {out} is a folder: give a file name, e.g. {out / 'report.html'}")
    with plain_failures(paths, recipe, "write the report elsewhere with --out FILE", where=out or paths.root):
        return write_report(study, recipe, paths, out)


def estimate_candidate(recipe: Recipe, as_json: bool, raw_pins: dict[str, str] | None = None) -> bool:
    """Print the memory model's breakdown for the pinned candidate (defaults for the rest), the
    verdict and the model's typical error; True when it fits.

    A what-if calculator: ``raw_pins`` may hold any value of a parameter's type, also outside the
    space (a warning says so); a wrong type, an unknown name or a candidate TRL refuses is bad input.
    """
    from autotune.candidate.estimate import estimate_for
    from autotune.candidate.memory import TYPICAL_REL_ERROR

    space = load_space(recipe.space or None)
    warnings = constraints.pin(recipe, space, raw_pins or {}, what_if=True)
    model = resolve_model(recipe.model)
    params = constraints.derive({**space.defaults(), **recipe.pins}, recipe)
    params = space.normalize(params)
    broken = constraints.violations(params, recipe)
    if broken:
        raise UsageError(f"this candidate cannot run (TRL or DeepSpeed refuses it): {broken[0]}")
    est = estimate_for(model, recipe, params, space)
    spread = TYPICAL_REL_ERROR * est.total_gib
    uncertainty = (
        f"uncertainty +/-{TYPICAL_REL_ERROR:.0%} (+/-{spread:.1f} GiB): it read 2-5% above 5 peaks "
        "measured on one H100 (Qwen2.5-1.5B, no vLLM); untested on other models, GPU counts, vLLM"
    )
    import sys

    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if as_json:
        print(
            json.dumps(
                {
                    **est.to_json(),
                    "params": params,
                    "typical_rel_error": TYPICAL_REL_ERROR,
                    "warnings": warnings,
                },
                indent=2,
            )
        )
        return est.fits
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for name, value in est.parts.items():
        table.add_row(name.replace("_", " "), f"{value:.2f}")
    if est.generation_sequences:
        table.add_row(f"generate() ({est.generation_sequences} seqs)", f"{est.generation_gib:.2f}")
    table.add_row(f"total ({est.phase} peak)", f"{est.total_gib:.2f}", style="bold")
    table.add_row("capacity", f"{est.capacity_gib:.2f}")
    console = Console(width=120)
    console.print(f"{recipe.model} on {recipe.gpus} x {recipe.gpu_type}: predicted peak memory per GPU")
    console.print(table)
    console.print(short_params(params))
    verdict = "fits" if est.fits else "does NOT fit"
    console.print(
        f"{verdict}: {est.total_gib:.1f} of {est.capacity_gib:.1f} GiB"
        + (f" ({est.total_gib / est.capacity_gib:.0%})" if est.capacity_gib else "")
        + f", {uncertainty}"
    )
    if est.fits and est.total_gib + spread > est.capacity_gib:
        console.print("- within the model's typical error of capacity: it may not fit")
    for note in est.notes:
        console.print(f"- {note}")
    return est.fits


def verify_best(name: str, runs_dir: Path, steps: int) -> bool:
    """Replay best/params.json as one longer trial with the study's runner: does it hold?

    The trial runs to warm-up + ``steps`` measured steps with no early stop and no pruning, in
    runs/<study>/verify/<n>/, and is judged like any trial, plus the headroom rule.
    """
    paths, recipe, _ = open_named(name, runs_dir)
    params_file = paths.best / PARAMS_JSON
    if not params_file.exists():
        raise UsageError(f"{params_file} does not exist: run autotune export {name} first")
    try:
        params = json.loads(params_file.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{params_file} is not valid JSON ({exc.msg}, line {exc.lineno}): "
            f"rewrite it with autotune export {name}"
        ) from None
    if steps < 1:
        raise UsageError("--steps must be at least 1")
    context = context_for(recipe)
    space = context.space
    runner = make_runner(context)
    forced = runner.forced()
    if not isinstance(params, dict):
        raise UsageError(f"{params_file} must be a JSON object of parameter values")
    for key, value in params.items():
        if (
            key in space.params
            and space.relevant(key, params)
            and not space.params[key].contains(value)
            and key not in recipe.pins
            and key not in forced
            and key != "gradient_accumulation_steps"
        ):
            raise UsageError(f"{params_file}: {key}={value!r} is not {space.params[key].allowed()}")
    broken = constraints.violations(params, recipe, runner.rules())
    if broken:
        raise UsageError(f"{params_file} cannot run here: {broken[0]}")
    root = paths.root / "verify"
    number = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0)
    trial_dir = root / str(number)
    recipe.trial_timeout_s = recipe.trial_timeout_s * max(
        1.0, (recipe.warmup_steps + steps) / (recipe.warmup_steps + recipe.measure_steps)
    )
    rule = StopRule(warmup=recipe.warmup_steps, measure=steps, adaptive=False, prune=False)
    print(f"verifying {short_params(params)} for {recipe.warmup_steps} + {steps} steps in {trial_dir}")
    with plain_failures(paths, recipe, ROOM_FOR_STUDY):
        outcome = runner.run(
            params,
            trial_dir,
            VERIFY_NUMBER_OFFSET + number,
            TrialControl(rule, None, constraints.samples_per_step(params, recipe, space), purpose="verify"),
        )
        limit = headroom_limit(recipe)
        peak = outcome.peak_memory_gib
        within = limit is None or peak is None or peak <= limit
        held = outcome.status == "ok" and within
        outcome.extra["held"] = held
        outcome.write(TrialFiles(trial_dir).outcome)
    if outcome.status == "ok":
        print(f"throughput: {outcome.throughput:.4g} completions/s over {outcome.steps} steps")
    else:
        kind = f"/{outcome.oom_kind}" if outcome.oom_kind else ""
        print(
            f"failed: {outcome.status}{kind} after {outcome.steps} steps: "
            f"{outcome.error_line or outcome.detail}"
        )
    if peak is not None:
        what = "host RSS" if recipe.device == "cpu" else "GPU"
        cap = (
            recipe.memory_limit_gib
            if recipe.device == "cpu" and recipe.memory_limit_gib
            else recipe.gpu_memory_gib
        )
        rule = (
            f"headroom limit {limit:.2f} GiB"
            if limit is not None
            else "no headroom judged without --memory-limit"
        )
        print(f"peak memory ({what}): {peak:.2f} GiB of {cap:.2f} GiB capacity ({peak / cap:.0%}; {rule})")
    if held:
        print("held: yes")
    elif outcome.status != "ok":
        print(
            f"held: NO (the run failed: {outcome.status}{'/' + outcome.oom_kind if outcome.oom_kind else ''})"
        )
    else:
        print(f"held: NO (peak {peak:.2f} GiB is above the headroom limit {limit:.2f} GiB)")
    return held
