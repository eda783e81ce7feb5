"""Search spaces: which knobs a search may turn, loaded from YAML and validated.

A space file (``search_spaces/grpo.yaml``) is user-editable, so every schema error names the file,
the line, the key and what is allowed. Values pinned with ``--set`` are checked against the same
definitions. The space knows nothing about GPUs or TRL rules: those live in ``constraints``; reading and
checking the file is :mod:`autotune.candidate.space_file`'s job.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml

from autotune.candidate.batch import GlobalBatch, mapping
from autotune.candidate.space_rules import SpaceRule
from autotune.errors import UsageError

TYPES = ("int", "float", "bool", "categorical")


def default_space_path() -> Path:
    """The shipped GRPO space (``autotune/spaces`` links to the top-level ``search_spaces``)."""
    return Path(__file__).resolve().parents[1] / "spaces" / "grpo.yaml"


@dataclass(frozen=True)
class Param:
    """One searchable knob."""

    name: str
    type: str
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    default: Any = None
    requires: dict[str, Any] = field(default_factory=dict)
    help: str = ""
    memory: str | None = None  # up | down | none: how a larger value moves GPU memory (None: unknown)

    def distribution(self) -> optuna.distributions.BaseDistribution:
        if self.choices is not None:
            return optuna.distributions.CategoricalDistribution(list(self.choices))
        if self.type == "int":
            return optuna.distributions.IntDistribution(
                int(self.low), int(self.high), log=self.log, step=int(self.step or 1)
            )
        return optuna.distributions.FloatDistribution(
            float(self.low), float(self.high), log=self.log, step=self.step
        )

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(
                self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log
            )
        return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if self.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return False
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if not (self.low - 1e-9 <= value <= self.high + 1e-9):
            return False
        if self.step:
            k = (value - self.low) / self.step
            return abs(k - round(k)) < 1e-6
        return True

    def allowed(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(_show(c) for c in self.choices)
        step = f" in steps of {_show(self.step)}" if self.step else ""
        return f"{self.type} from {_show(self.low)} to {_show(self.high)}{step}"

    def coerce(self, text: str) -> Any:
        """Read a ``--set`` value written on the command line into this parameter's type."""
        value = _parse_scalar(text)
        if self.type == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.type == "bool" and isinstance(value, str) and value.lower() in ("yes", "on", "no", "off"):
            value = value.lower() in ("yes", "on")
        return value

    def grid_values(self, float_points: int = 3) -> list[Any]:
        """Values for exhaustive checks; continuous ranges are represented by a few points."""
        if self.choices is not None:
            return list(self.choices)
        if self.type == "int" and (self.high - self.low) / (self.step or 1) <= 64:
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.type == "float" and self.step:
            # a stepped knob of few values is listed whole: evenly spaced points snapped to its step
            # skip some (0.3-0.9 by 0.1 at 5 points has no 0.4, where a PPO landscape's best sat)
            count = int(round((self.high - self.low) / self.step)) + 1
            if count <= 2 * float_points - 1:
                return [round(self.low + i * self.step, 10) for i in range(count)]
        values = [self.low + (self.high - self.low) * i / (float_points - 1) for i in range(float_points)]
        if self.type == "int":
            step = int(self.step or 1)
            values = [int(self.low + round((v - self.low) / step) * step) for v in values]
            return sorted(set(values))
        if self.step:  # stay on the parameter's own grid
            values = [round(self.low + round((v - self.low) / self.step) * self.step, 10) for v in values]
        return sorted(set(values))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


@dataclass
class Space:
    """The parameters of a search, in file order, and how they make the global batch."""

    params: dict[str, Param]
    path: Path
    digest: str
    declared_batch: GlobalBatch | None = None  # the file's ``global_batch:`` block, if any
    rules: tuple[SpaceRule, ...] = ()  # the file's ``rules:`` (candidate/space_rules.py)

    @property
    def batch(self) -> GlobalBatch | None:
        """How the global batch is made: the declared block, TRL's names when the space has
        ``per_device_train_batch_size``, else None (the space says nothing about the batch)."""
        return mapping(self.declared_batch, self.params)

    def __contains__(self, name: str) -> bool:
        return name in self.params

    def defaults(self) -> dict[str, Any]:
        return {name: p.default for name, p in self.params.items()}

    def relevant(self, name: str, values: dict[str, Any]) -> bool:
        """Whether a parameter matters given the others (``requires``)."""
        req = self.params[name].requires
        return all(values.get(k) == v for k, v in req.items())

    def normalize(self, values: dict[str, Any]) -> dict[str, Any]:
        """Drop parameters that do not matter for this candidate, so equal configs compare equal."""
        full = {**self.defaults(), **values}
        out = {}
        for name in self.params:
            if self.relevant(name, full):
                value = full[name]
                if self.params[name].type == "float" and value is not None:
                    value = round(float(value), 6)
                out[name] = value
        for name, value in values.items():
            if name not in self.params:
                out[name] = value
        return out

    def read_pins(self, raw: dict[str, str]) -> dict[str, Any]:
        """``--set NAME=VALUE`` texts in each parameter's type; an unknown name raises."""
        pins = {}
        for name, text in raw.items():
            if name not in self.params:
                self.check_pins({name: text})  # raises the unknown-parameter error
            pins[name] = self.params[name].coerce(text)
        return pins

    def check_pins(self, pins: dict[str, Any]) -> None:
        for name, value in pins.items():
            if name not in self.params:
                raise UsageError(
                    f"--set {name}: unknown parameter; the space {self.path} has " + ", ".join(self.params)
                )
            param = self.params[name]
            if not param.contains(value):
                raise UsageError(
                    f"--set {name}={_show(value)} is out of range: {name} is {param.allowed()} "
                    f"({self.how_to_widen()})"
                )

    def how_to_widen(self) -> str:
        """Where to widen a range: a copy passed with ``--space``, never the installed package."""
        if self.path.resolve() == default_space_path().resolve():
            return (
                f"to widen it, copy the shipped space: cp {self.path} my_space.yaml, edit the copy "
                "and pass --space my_space.yaml"
            )
        return f"widen it in {self.path}, the file given to --space"

    def outside(self, pins: dict[str, Any]) -> list[str]:
        """Pins outside the space but of the parameter's type, as warnings (``estimate`` is a
        what-if calculator); a wrong type or an unknown name still raises."""
        warnings = []
        for name, value in pins.items():
            if name not in self.params:
                self.check_pins({name: value})
            param = self.params[name]
            if param.contains(value):
                continue
            if not type_ok(param.type, value) or (param.type == "float" and isinstance(value, bool)):
                raise UsageError(
                    f"--set {name}={_show(value)}: {name} takes {param.type} values "
                    f"(the space has {param.allowed()})"
                )
            warnings.append(
                f"--set {name}={_show(value)} is outside the space ({name} is {param.allowed()}); "
                "estimated anyway"
            )
        return warnings

    def suggest(self, trial: optuna.Trial, fixed: dict[str, Any]) -> dict[str, Any]:
        """Ask Optuna for every parameter that is not fixed (pinned or derived)."""
        values = dict(fixed)
        for name, param in self.params.items():
            if name in fixed:
                continue
            values[name] = param.suggest(trial)
        return values

    def grid(
        self, fixed: dict[str, Any], names: list[str] | None = None, float_points: int = 3
    ) -> Iterator[dict[str, Any]]:
        """Every combination of the discrete values of ``names`` (all params by default);
        continuous ranges contribute ``float_points`` evenly spaced values."""
        names = [n for n in (names or list(self.params)) if n not in fixed and n in self.params]
        axes = [self.params[n].grid_values(float_points) for n in names]
        for combo in itertools.product(*axes):
            yield {**self.defaults(), **fixed, **dict(zip(names, combo))}


def type_ok(ptype: str, value: Any) -> bool:
    if ptype == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if ptype == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ptype == "bool":
        return isinstance(value, bool)
    return isinstance(value, (str, int, float, bool))
