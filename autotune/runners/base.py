"""The runner interface and what every runner is given."""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.candidate.space import Space
from autotune.files import write_json
from autotune.hardware import GpuType
from autotune.models import ModelSpec
from autotune.recipe import Recipe
from autotune.trial.control import TrialControl
from autotune.trial.execute import execute, fresh_trial_dir
from autotune.trial.launch import LaunchSpec
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import Outcome

Rule = Callable[[dict[str, Any]], "str | None"]

#: Extra steps beyond warm-up and measurement: the controller stops a trial once it has measured,
#: so these only matter when a step's metrics line is late.
EXTRA_STEPS = 2

# The GPUs of the slot the current thread's trial runs on (parallel trials, search/parallel.py).
# A context variable, not an attribute of the runner: one runner serves every slot at once.
ASSIGNED_GPUS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "autotune_gpus", default=None
)


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it), for one trial's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def steps_needed(control: TrialControl) -> int:
    """Optimizer steps a trial under ``control`` must be able to run: warm-up, the measured steps
    and, for an adaptive rule, the steps it may add (confirmation and verify runs are longer)."""
    rule = control.rule
    return rule.warmup + rule.measure + (rule.extra if rule.adaptive else 0)


def max_steps(recipe: Recipe, needed: int | None) -> int:
    """The ``max_steps`` a real trainer is given: the recipe's warm-up and measured steps, or what
    the trial needs, whichever is more, plus :data:`EXTRA_STEPS` for a late metrics line."""
    default = int(recipe.warmup_steps) + int(recipe.measure_steps) + EXTRA_STEPS
    return max(default, (needed or 0) + EXTRA_STEPS)


@contextlib.contextmanager
def on_gpus(devices: list[int] | None) -> Iterator[None]:
    """Run the trials started inside on ``devices`` (None: the first --gpus of the node)."""
    token = ASSIGNED_GPUS.set(list(devices) if devices is not None else None)
    try:
        yield
    finally:
        ASSIGNED_GPUS.reset(token)


@dataclass
class TrialContext:
    """Everything fixed for the whole study that a runner may need."""

    recipe: Recipe
    space: Space
    model: ModelSpec
    gpu: GpuType


class Runner:
    """Base class: subclasses implement :meth:`prepare`."""

    name = "base"
    monitors_gpus = True  # sample NVML/psutil while the trial runs (the simulator uses no GPU)

    def start_services(self, spec: LaunchSpec) -> list[Any]:
        """Start what the trial needs beside it (``spec.sidecars``); raise ServiceFailed."""
        return []

    def stop_services(self, handles: list[Any]) -> None:
        """Stop what :meth:`start_services` started, whatever happened to the trial."""

    def __init__(self, context: TrialContext) -> None:
        self.context = context
        self.recipe = context.recipe

    def check(self) -> None:
        """Raise UsageError when this runner cannot work with the recipe (checked once, up front)."""

    def searched(self) -> set[str] | None:
        """Parameters this runner can actually change; None means all of the space."""
        return None

    def rules(self) -> list[Rule]:
        """Extra validity rules (e.g. a package that is not installed)."""
        return []

    def forced(self) -> dict[str, Any]:
        """Values this runner must use whatever the space says (no vLLM on CPU, say). Pins win:
        a pinned value the runner cannot honour is refused by :meth:`rules` instead."""
        return {}

    def prepare(
        self, params: dict[str, Any], trial_dir: Path, number: int, steps_needed: int | None = None
    ) -> LaunchSpec:
        """The trial's launch: ``steps_needed`` is what run() says this trial must be able to run
        (None: the recipe's warm-up and measured steps). Passed along, not kept on the runner,
        because one runner prepares the trials of every parallel slot at once."""
        raise NotImplementedError

    @contextlib.contextmanager
    def services(self, spec: LaunchSpec) -> Iterator[list[Any]]:
        """:meth:`start_services` on entry and :meth:`stop_services` on exit, whatever happens."""
        handles = self.start_services(spec)
        try:
            yield handles
        finally:
            self.stop_services(handles)

    def run(self, params: dict[str, Any], trial_dir: Path, number: int, control: TrialControl) -> Outcome:
        """Run one candidate as a real process until ``control`` says it is measured."""
        fresh_trial_dir(trial_dir)
        spec = self.prepare(params, trial_dir, number, steps_needed(control))
        write_json(TrialFiles(trial_dir).params, params)
        return execute(
            spec, params, self.recipe, control, monitors_gpus=self.monitors_gpus, services=self.services(spec)
        )

    def base_env(self, trial_dir: Path) -> dict[str, str]:
        """The trial contract's environment (docs/trial-contract.md): folder, metrics file, GPUs: the slot's
        when trials run in parallel (:func:`on_gpus`), else the first --gpus visible ones."""
        gpus = self.recipe.gpus
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        assigned = ASSIGNED_GPUS.get()
        if assigned is not None:
            devices = [str(d) for d in assigned]
        elif visible:
            devices = [d for d in visible.split(",") if d.strip()][:gpus]
        else:
            devices = [str(i) for i in range(gpus)]
        return {
            "AUTOTUNE_TRIAL_DIR": str(trial_dir),
            "AUTOTUNE_METRICS_FILE": str(TrialFiles(trial_dir).metrics),
            "CUDA_VISIBLE_DEVICES": ",".join(devices),
            "PYTHONUNBUFFERED": "1",
        }
