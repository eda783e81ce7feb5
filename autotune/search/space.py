"""Search spaces: which knobs a search may turn, loaded from YAML and validated.

A space file (``search_spaces/grpo.yaml``) is user-editable, so every schema error names the file,
the line, the key and what is allowed. Values pinned with ``--set`` are checked against the same
definitions. The space knows nothing about GPUs or TRL rules: those live in ``constraints``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml

from autotune.errors import UsageError

TYPES = ("int", "float", "bool", "categorical")
PARAM_KEYS = {"type", "choices", "low", "high", "step", "log", "default", "requires", "help"}
BATCH_KEYS = ("micro_batch", "accumulation", "per", "generations")
BATCH_PER = ("gpu", "all")


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


@dataclass(frozen=True)
class GlobalBatch:
    """Which parameters make the global batch (completions per optimizer step), by name.

    TRL's names need no declaration; a trainer with its own names (OpenRLHF's
    ``micro_train_batch_size``) declares them in the space's ``global_batch:`` block, so that
    ``--global-batch`` can derive the accumulation and the rules look at the right knobs:
    completions per step = micro_batch x accumulation (1 when not named) x data-parallel GPUs (x 1
    with ``per: all``). ``generations`` is the group size: a step must hold whole groups.
    """

    micro_batch: str
    accumulation: str | None = None
    per: str = "gpu"
    generations: str | None = None
    declared: bool = False  # written in the space, not TRL's names taken as they are

    def gpus_factor(self, dp: int) -> int:
        """GPUs the micro-batch is multiplied by: the data-parallel ones, or 1 with ``per: all``."""
        return max(dp, 1) if self.per == "gpu" else 1

    def accumulation_of(self, params: dict[str, Any], dp: int, global_batch: int | None) -> int | None:
        """Micro-steps per optimizer step: the parameter's value, the one ``--global-batch`` implies
        when the trainer derives it itself (no accumulation parameter), or 1; None when the global
        batch does not divide."""
        if self.accumulation is not None and params.get(self.accumulation) is not None:
            return int(params[self.accumulation])
        if global_batch:
            per_micro = int(params[self.micro_batch]) * self.gpus_factor(dp)
            return global_batch // per_micro if global_batch % per_micro == 0 else None
        return 1

    def completions(self, params: dict[str, Any], dp: int, global_batch: int | None = None) -> int | None:
        """Completions per optimizer step, or None when the candidate does not say (no micro-batch)."""
        if params.get(self.micro_batch) is None:
            return None
        accumulation = self.accumulation_of(params, dp, global_batch)
        if accumulation is None:
            return None
        return int(params[self.micro_batch]) * accumulation * self.gpus_factor(dp)


TRL_BATCH = GlobalBatch(
    micro_batch="per_device_train_batch_size",
    accumulation="gradient_accumulation_steps",
    per="gpu",
    generations="num_generations",
)


@dataclass
class Space:
    """The parameters of a search, in file order, and how they make the global batch."""

    params: dict[str, Param]
    path: Path
    digest: str
    declared_batch: GlobalBatch | None = None  # the file's ``global_batch:`` block, if any

    @property
    def batch(self) -> GlobalBatch | None:
        """How the global batch is made: the declared block, TRL's names when the space has
        ``per_device_train_batch_size``, else None (the space says nothing about the batch)."""
        if self.declared_batch is not None:
            return self.declared_batch
        return TRL_BATCH if "per_device_train_batch_size" in self.params else None

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
            if not _type_ok(param.type, value) or (param.type == "float" and isinstance(value, bool)):
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


def _line_of(node: yaml.Node | None) -> int:
    return node.start_mark.line + 1 if node is not None else 1


def load_space(path: str | Path | None = None) -> Space:
    """Load and validate a space file. Errors are one line: ``file:line: key: what is allowed``."""
    path = Path(path) if path else default_space_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"search space {path} does not exist: give an existing file to --space") from None
    except OSError as exc:
        raise UsageError(f"cannot read search space {path}: {exc.strerror}") from None
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        opened = ""
        if exc.context_mark is not None and exc.context_mark.line + 1 != line:
            opened = f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise UsageError(f"{path}:{line}: invalid YAML: {exc.problem or exc}{opened}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: invalid YAML: {exc}") from None

    def fail(node: yaml.Node | None, message: str) -> UsageError:
        return UsageError(f"{path}:{_line_of(node)}: {message}")

    if not isinstance(data, dict) or not isinstance(data.get("parameters"), dict) or not data["parameters"]:
        raise fail(root, "a space needs a non-empty 'parameters:' mapping")
    pnodes = {k.value: v for k, v in _mapping(root).items()}.get("parameters")
    nodes = {k.value: (k, v) for k, v in _mapping(pnodes).items()}
    params: dict[str, Param] = {}
    for name, spec in data["parameters"].items():
        knode, vnode = nodes.get(str(name), (None, None))
        if not isinstance(spec, dict):
            raise fail(knode, f"parameter '{name}' must be a mapping with type/choices/default")
        fields_ = {k.value: k for k in _mapping(vnode)}
        unknown = set(spec) - PARAM_KEYS
        if unknown:
            key = sorted(unknown)[0]
            raise fail(
                fields_.get(key, knode),
                f"{name}: unknown key '{key}'; allowed: {', '.join(sorted(PARAM_KEYS))}",
            )
        ptype = spec.get("type")
        if ptype not in TYPES:
            raise fail(fields_.get("type", knode), f"{name}.type is {ptype!r}; allowed: {', '.join(TYPES)}")
        choices = spec.get("choices")
        if choices is not None:
            if not isinstance(choices, list) or not choices:
                raise fail(fields_.get("choices"), f"{name}.choices must be a non-empty list")
            for c in choices:
                if not _type_ok(ptype, c):
                    raise fail(fields_.get("choices"), f"{name}.choices has {c!r}, not a {ptype}")
            if len(set(map(repr, choices))) != len(choices):
                raise fail(fields_.get("choices"), f"{name}.choices repeats a value")
        elif ptype in ("bool", "categorical"):
            raise fail(knode, f"{name}: a {ptype} parameter needs 'choices'")
        else:
            for key in ("low", "high"):
                if not _type_ok(ptype, spec.get(key)) and not (
                    ptype == "float" and _type_ok("int", spec.get(key))
                ):
                    raise fail(fields_.get(key, knode), f"{name}: needs 'choices' or numeric '{key}'")
            if spec["low"] > spec["high"]:
                raise fail(fields_.get("low"), f"{name}: low {spec['low']} is above high {spec['high']}")
            step = spec.get("step")
            if step is not None and (not isinstance(step, (int, float)) or step <= 0):
                raise fail(fields_.get("step"), f"{name}.step must be a positive number")
            if spec.get("log") and spec["low"] <= 0:
                raise fail(fields_.get("log"), f"{name}: log scale needs low > 0")
            if spec.get("log") and step is not None:
                raise fail(fields_.get("log"), f"{name}: use either log or step, not both")
            if ptype == "int" and step is not None and not isinstance(step, int):
                raise fail(fields_.get("step"), f"{name}.step must be a whole number for an int parameter")
        requires = spec.get("requires") or {}
        if not isinstance(requires, dict):
            raise fail(fields_.get("requires"), f"{name}.requires must map parameter names to values")
        param = Param(
            name=str(name),
            type=ptype,
            choices=tuple(choices) if choices is not None else None,
            low=spec.get("low"),
            high=spec.get("high"),
            step=spec.get("step"),
            log=bool(spec.get("log", False)),
            default=spec.get("default"),
            requires=dict(requires),
            help=str(spec.get("help", "")),
        )
        if param.default is None:
            raise fail(knode, f"{name}: needs a 'default' (used when it is not searched)")
        if not param.contains(param.default):
            raise fail(fields_.get("default"), f"{name}.default {param.default!r} is not {param.allowed()}")
        params[str(name)] = param
    for param in params.values():
        for dep, value in param.requires.items():
            knode = nodes.get(param.name, (None, None))[0]
            if dep not in params:
                raise fail(knode, f"{param.name}.requires names unknown parameter '{dep}'")
            if not params[dep].contains(value):
                raise fail(
                    knode, f"{param.name}.requires {dep}={value!r} but {dep} is {params[dep].allowed()}"
                )
    batch = None
    if "global_batch" in data:
        bnode = {k.value: (k, v) for k, v in _mapping(root).items()}.get("global_batch", (None, None))
        batch = _load_batch(data["global_batch"], bnode, params, fail)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Space(params=params, path=path, digest=digest, declared_batch=batch)


def _load_batch(spec: Any, nodes: tuple[Any, Any], params: dict[str, Param], fail: Any) -> GlobalBatch:
    """Read and check the ``global_batch:`` block: each key names an int parameter of the space."""
    knode, vnode = nodes
    keys = {k.value: k for k in _mapping(vnode)}
    if not isinstance(spec, dict) or "micro_batch" not in spec:
        raise fail(
            knode,
            "global_batch needs 'micro_batch' (the parameter with completions per GPU per "
            "micro-step), e.g. {micro_batch: PARAM, accumulation: PARAM, per: gpu}",
        )
    unknown = sorted(set(map(str, spec)) - set(BATCH_KEYS))
    if unknown:
        raise fail(
            keys.get(unknown[0]),
            f"global_batch: unknown key '{unknown[0]}'; allowed: {', '.join(BATCH_KEYS)}",
        )
    named = [spec[k] for k in ("micro_batch", "accumulation", "generations") if k in spec]
    for key in ("micro_batch", "accumulation", "generations"):
        name = spec.get(key)
        if key in spec and (not isinstance(name, str) or name not in params or params[name].type != "int"):
            raise fail(
                keys.get(key),
                f"global_batch.{key} is {name!r}, not an int parameter of this space; "
                f"the parameters are {', '.join(params)}",
            )
    if len(set(named)) != len(named):
        raise fail(
            knode, "global_batch: micro_batch, accumulation and generations must name different parameters"
        )
    per = spec.get("per", "gpu")
    if per not in BATCH_PER:
        raise fail(
            keys.get("per"),
            f"global_batch.per is {per!r}; allowed: gpu (the micro-batch is per GPU) "
            "or all (it counts every GPU's completions)",
        )
    generations = spec.get("generations")
    trl_group = getattr(params.get("num_generations"), "type", "") == "int" and "num_generations" not in named
    if generations is None and trl_group:
        generations = "num_generations"  # TRL's name for the group size applies as it is
    return GlobalBatch(
        micro_batch=spec["micro_batch"],
        accumulation=spec.get("accumulation"),
        per=per,
        generations=generations,
        declared=True,
    )


def _mapping(node: yaml.Node | None) -> dict:
    if isinstance(node, yaml.MappingNode):
        return {k: v for k, v in node.value}
    return {}


def _type_ok(ptype: str, value: Any) -> bool:
    if ptype == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if ptype == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ptype == "bool":
        return isinstance(value, bool)
    return isinstance(value, (str, int, float, bool))
