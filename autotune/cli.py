"""The command line. Thin on purpose: it parses, builds a Recipe and calls :mod:`autotune.commands`.

The options that describe a search are derived from the :class:`Recipe` dataclass (its field
metadata holds each help text, its defaults are the only defaults), so the CLI, the saved
recipe.yaml and the README cannot drift apart. Every user mistake surfaces as ``error: <one
line>`` with exit status 2 (:class:`autotune.errors.UsageError` is a ``click.ClickException``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from autotune import __version__
from autotune.errors import UsageError
from autotune.recipe import Recipe, default_study_name, format_duration, parse_duration
from autotune.runners import RUNNERS

FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
CHOICES = {"runner": RUNNERS, "device": ("cuda", "cpu"), "quantization": ("4bit", "8bit")}
TYPES = {"int": int, "float": float, "str": str}


def recipe_option(name: str, **overrides: Any) -> Callable[[Callable], Callable]:
    """A click option for the Recipe field ``name``: flag, help and default from the field."""
    f = FIELDS[name]
    meta = f.metadata
    flag = meta.get("flag") or "--" + name.replace("_", "-")
    kwargs: dict[str, Any] = {"help": meta["help"], "default": None}
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        kwargs["required"] = True
    elif f.default not in (None, dataclasses.MISSING) and not meta.get("resolved"):
        kwargs.update(
            show_default=True,
            default=format_duration(f.default) if meta.get("kind") == "duration" else f.default,
        )
    base = str(f.type).split("|")[0].strip()
    if name in CHOICES:
        kwargs["type"] = click.Choice(CHOICES[name])
    elif name == "pins":
        kwargs.update(multiple=True, metavar="NAME=VALUE", default=())
    elif name == "space":
        kwargs["type"] = click.Path(path_type=Path)
    elif meta.get("kind") == "duration":
        kwargs["type"] = str
    else:
        kwargs["type"] = TYPES.get(base, str)
    kwargs.update(overrides)
    return click.option(flag, name, **kwargs)


def recipe_options(commands: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Every Recipe field that the given commands take, in the dataclass's order."""
    names = [n for n, f in FIELDS.items() if f.metadata.get("commands") in commands]

    def decorate(func: Callable) -> Callable:
        for name in reversed(names):
            func = recipe_option(name)(func)
        return func

    return decorate


runs_dir_option = click.option(
    "--runs-dir",
    type=click.Path(path_type=Path),
    default=Path("runs"),
    show_default=True,
    help="Folder that holds the studies.",
)
shared_option = click.option(
    "--storage",
    "storage",
    default=None,
    metavar="URL",
    help="A study shared through this storage (PostgreSQL) that this node did not "
    "start: its recipe is read from there (docs/cluster.md).",
)


def adopt(study: str, runs_dir: Path, storage: str | None) -> None:
    """A node that never ran the search takes the shared study's recipe from its storage."""
    if storage:
        from autotune.study.paths import StudyPaths
        from autotune.study.storage import adopt_shared_study

        adopt_shared_study(StudyPaths(runs_dir, study), storage)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a scheduler's stop, a closed terminal): handled exactly like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, frame: Any) -> None:
    """Raise :class:`Terminated` (or, for Ctrl-C, KeyboardInterrupt) in the main thread, once: a
    second signal must not cut short the cleanup the first one started, which kills the trials'
    process groups (a scheduler follows up with SIGKILL anyway; kill -9 still ends us)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def handle_termination() -> dict[signal.Signals, Any]:
    """SIGTERM and SIGHUP raise like Ctrl-C, so trials are killed and the study stays resumable;
    after the first of them (Ctrl-C included) the others are ignored until the cleanup is done.

    Only where they would kill us outright (a ``nohup`` run keeps ignoring SIGHUP); returns the
    handlers replaced, for :func:`restore_handlers`.
    """
    replaced: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                replaced[sig] = signal.signal(sig, _terminate)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            replaced[signal.SIGINT] = signal.signal(signal.SIGINT, _terminate)
    return replaced


def restore_handlers(replaced: dict[signal.Signals, Any]) -> None:
    """Put back what :func:`handle_termination` replaced (the CLI may run inside another program)."""
    for sig, handler in replaced.items():
        signal.signal(sig, handler)


class Group(click.Group):
    """Ctrl-C, SIGTERM and SIGHUP leave the study resumable and say so, instead of click's bare
    'Aborted!' or a death that skips all cleanup (exit 128 + the signal's number)."""

    def invoke(self, ctx: click.Context) -> Any:
        replaced = handle_termination()
        try:
            return super().invoke(ctx)
        except Terminated as exc:
            click.echo(
                f"stopped by {signal.Signals(exc.signum).name}: the study is saved; "
                "continue with autotune resume",
                err=True,
            )
            sys.exit(128 + exc.signum)
        except KeyboardInterrupt:
            click.echo("interrupted: the study is saved; continue with autotune resume", err=True)
            sys.exit(130)
        finally:
            restore_handlers(replaced)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autotune")
@click.option("-v", "--verbose", count=True, help="More log detail (-vv for debug).")
def main(verbose: int) -> None:
    """Find the fastest GRPO configuration that fits your GPUs, by running short trials."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )


@main.command()
@recipe_options(("recipe", "search"))
@runs_dir_option
def search(runs_dir: Path, **kw: Any) -> None:
    """Search for the fastest configuration that stays in memory."""
    from autotune.commands.search import start_search

    start_search(recipe_from_flags(kw), runs_dir)


def parse_pins(items: tuple[str, ...]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set {item}: write NAME=VALUE, e.g. --set num_generations=8")
        name, value = item.split("=", 1)
        pins[name.strip()] = value.strip()
    return pins


def recipe_from_flags(kw: dict[str, Any]) -> Recipe:
    """Check every flag and build the recipe; the first mistake found is reported."""
    from autotune.commands.inputs import resolve_inputs

    for name in ("trials", "max_prompt_length", "max_completion_length", "measure_steps"):
        if kw.get(name) is not None and kw[name] < 1:
            raise UsageError(
                f"{FIELDS[name].metadata.get('flag') or '--' + name.replace('_', '-')} must be at least 1"
            )
    if kw.get("patience") is not None and kw["patience"] < 0:
        raise UsageError("--patience must be at least 0 (0: never stop for want of a gain)")
    if kw.get("warmup_steps") is not None and kw["warmup_steps"] < 0:
        raise UsageError("--warmup-steps must be at least 0")
    if kw.get("global_batch") is not None and kw["global_batch"] < 1:
        raise UsageError("--global-batch must be at least 1")
    if kw.get("gpu_memory_gib") is not None and kw["gpu_memory_gib"] <= 0:
        raise UsageError("--gpu-memory is GiB per GPU and must be positive, e.g. 79.3")
    if kw.get("memory_limit_gib") is not None and kw["memory_limit_gib"] <= 0:
        raise UsageError("--memory-limit is GiB per trial and must be positive, e.g. 3")
    if kw.get("lora_rank") is not None and kw["lora_rank"] < 1:
        raise UsageError("--lora-rank must be at least 1 (leave it out for full fine-tuning)")
    if kw.get("beta") is not None and kw["beta"] < 0:
        raise UsageError("--beta is a KL coefficient and cannot be negative")
    if kw.get("name"):
        from autotune.study.paths import study_name

        kw["name"] = study_name(kw["name"], "--name")
    if kw.get("seed") is not None and not 0 <= kw["seed"] < 2**32:
        raise UsageError(f"--seed {kw['seed']}: give a whole number from 0 to {2**32 - 1}")
    scale = kw.get("sim_time_scale")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise UsageError(f"--sim-time-scale {scale}: give a positive number of wall seconds, e.g. 0.002")
    if kw.get("headroom") is not None and not 0 <= kw["headroom"] < 1:
        raise UsageError("--headroom is a fraction of GPU memory between 0 and 1, e.g. 0.05")
    if kw.get("min_util") is not None and not 0 <= kw["min_util"] <= 1:
        raise UsageError("--min-util is a fraction between 0 and 1, e.g. 0.5")
    if kw.get("command") and kw.get("runner") == "trl":
        kw["runner"] = "command"
    for duration in ("time_budget_s", "trial_timeout_s", "hang_timeout_s"):
        kw[duration] = parse_duration(kw.get(duration))
    if kw.get("confirm") is not None:
        kw["confirm"] = max(kw["confirm"], 0)
    raw = {k: kw.pop(k) for k in ("gpu_type", "gpu_memory_gib", "space", "pins")}
    recipe = Recipe(**{k: v for k, v in kw.items() if k in FIELDS and v is not None}, workdir=str(Path.cwd()))
    resolve_inputs(recipe, raw["gpu_type"], raw["gpu_memory_gib"], raw["space"], parse_pins(raw["pins"]))
    if not recipe.name:
        recipe.name = default_study_name(recipe.model, recipe.gpus, recipe.gpu_type)
    return recipe


@main.command()
@click.argument("study")
@runs_dir_option
@shared_option
@recipe_option("trials", help="New total of launched trials.", default=None, show_default=False)
@recipe_option("time_budget_s", help="New total time budget, e.g. 8h.", default=None, show_default=False)
def resume(
    study: str, runs_dir: Path, storage: str | None, trials: int | None, time_budget_s: str | None
) -> None:
    """Go on with a stopped or killed search where it left off."""
    from autotune.commands.search import resume_search

    adopt(study, runs_dir, storage)
    resume_search(study, runs_dir, trials=trials, time_budget_s=parse_duration(time_budget_s))


@main.command()
@click.argument("study")
@runs_dir_option
@shared_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show(study: str, runs_dir: Path, storage: str | None, as_json: bool) -> None:
    """The trials so far, best first."""
    from autotune.commands.show import show_study

    adopt(study, runs_dir, storage)
    show_study(study, runs_dir, as_json)


@main.command()
@click.argument("study")
@runs_dir_option
@shared_option
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Folder (default: runs/<study>/best)."
)
def export(study: str, runs_dir: Path, storage: str | None, out: Path | None) -> None:
    """(Re)write the launch configs of the best trial so far."""
    from autotune.commands.export import export_named

    adopt(study, runs_dir, storage)
    for path in export_named(study, runs_dir, out):
        click.echo(str(path))


@main.command()
@click.argument("study")
@runs_dir_option
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="HTML file (default: runs/<study>/report.html).",
)
def report(study: str, runs_dir: Path, out: Path | None) -> None:
    """Write the study's HTML report (plots; self-contained, opens offline)."""
    from autotune.commands.export import report_named

    click.echo(str(report_named(study, runs_dir, out)))


@main.command()
@click.argument("study")
@runs_dir_option
@click.option(
    "--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="Port to listen on."
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0: reachable from other machines).",
)
def dashboard(study: str, runs_dir: Path, port: int, host: str) -> None:
    """Browse the study in optuna-dashboard (optional extra); its best trial is the exported one."""
    from autotune.commands.opening import open_named
    from autotune.study.dashboard import require_dashboard, serve

    require_dashboard()
    paths, recipe, _ = open_named(study, runs_dir)
    serve(paths, recipe, host=host, port=port)


@main.command()
@click.argument("study")
@runs_dir_option
@click.option("--steps", type=int, default=20, show_default=True, help="Measured steps after warm-up.")
def verify(study: str, runs_dir: Path, steps: int) -> None:
    """Run best/params.json as one longer trial: does it hold?"""
    from autotune.commands.verify import verify_best

    if not verify_best(study, runs_dir, steps):
        sys.exit(1)


@main.command(name="run")
@click.argument("study")
@runs_dir_option
@click.option("--steps", type=int, required=True, help="Optimizer steps of the production run ({max_steps}).")
@click.option("--max-restarts", type=int, default=3, show_default=True, help="Restarts after failures.")
@click.option("--save-steps", type=int, default=0, help="Checkpoint every N steps (default: steps/20).")
@click.option("--memory-limit", type=float, default=None, help="RLIMIT_AS in GiB (default: the study's).")
@click.option(
    "--max-completion-length",
    type=int,
    default=None,
    help="This run's completion length (default: the study's).",
)
def run_cmd(study: str, runs_dir: Path, steps: int, max_restarts: int, save_steps: int, **kw: Any) -> None:
    """Run the exported configuration; after an OOM, resume on a safer one (docs: README "Run it")."""
    from autotune.commands.run import run_study
    from autotune.production.supervisor import RunOptions

    options = RunOptions(steps, max_restarts, save_steps, kw["memory_limit"])
    sys.exit(run_study(study, runs_dir, options, max_completion_length=kw["max_completion_length"]))


@main.command()
@recipe_options(("recipe",))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def estimate(as_json: bool, **kw: Any) -> None:
    """Predicted peak memory per GPU of one candidate, part by part (no GPU needed).

    Exit status 0 when it fits, 1 when it does not, 2 on bad input. ``--set`` takes any value of
    the parameter's type (a what-if), with a warning when it is outside the space."""
    from autotune.commands.estimate import estimate_candidate

    kw.update(runner="sim", device="cuda")
    raw_pins = parse_pins(kw.pop("pins", ()) or ())
    if not estimate_candidate(recipe_from_flags({**kw, "pins": ()}), as_json, raw_pins):
        sys.exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def doctor(as_json: bool) -> None:
    """What is there and what is missing for real trials."""
    from autotune.doctor import report

    data = report()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        click.echo(f"{key:>16}: {value}")


if __name__ == "__main__":  # pragma: no cover
    main()
