"""Reading a search space file: the YAML, its parameters, its ``global_batch:`` block and its
``rules:``, checked.

A space file is user-editable, so every schema error names the file, the line, the key and what
is allowed (``file:line: key: what is allowed``), in one line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from autotune.candidate.batch import GlobalBatch
from autotune.candidate.space import TYPES, Param, Space, default_space_path, type_ok
from autotune.candidate.space_rules import RuleError, SpaceRule
from autotune.errors import UsageError

PARAM_KEYS = {"type", "choices", "low", "high", "step", "log", "default", "requires", "help", "memory"}
TOP_KEYS = ("version", "parameters", "global_batch", "rules")
BATCH_KEYS = ("micro_batch", "accumulation", "per", "generations")
BATCH_PER = ("gpu", "all")


def _line_of(node: yaml.Node | None) -> int:
    return node.start_mark.line + 1 if node is not None else 1


def load_space(path: str | Path | None = None) -> Space:
    """Load and validate a space file. Errors are one line: ``file:line: key: what is allowed``."""
    path = (Path(path).expanduser() if path else default_space_path()).resolve()  # resume runs elsewhere
    text, root, data = _read(path)

    def fail(node: yaml.Node | None, message: str) -> UsageError:
        return UsageError(f"{path}:{_line_of(node)}: {message}")

    duplicate = _duplicate_key(root)
    if duplicate:
        raise fail(*duplicate)
    if not isinstance(data, dict) or not isinstance(data.get("parameters"), dict) or not data["parameters"]:
        raise fail(root, "a space needs a non-empty 'parameters:' mapping")
    unknown = [(k, k.value) for k in _mapping(root) if k.value not in TOP_KEYS]
    if unknown:
        raise fail(unknown[0][0], f"unknown key '{unknown[0][1]}'; allowed: {', '.join(TOP_KEYS)}")
    pnodes = {k.value: v for k, v in _mapping(root).items()}.get("parameters")
    nodes = {k.value: (k, v) for k, v in _mapping(pnodes).items()}
    params = {str(name): _load_param(name, spec, nodes, fail) for name, spec in data["parameters"].items()}
    for param in params.values():
        for dep, value in param.requires.items():
            knode = nodes.get(param.name, (None, None))[0]
            if dep not in params:
                raise fail(knode, f"{param.name}.requires names unknown parameter '{dep}'")
            if not params[dep].contains(value):
                raise fail(
                    knode, f"{param.name}.requires {dep}={value!r} but {dep} is {params[dep].allowed()}"
                )
    cycle = _requires_cycle(params)
    if cycle:
        raise fail(nodes.get(cycle[0], (None, None))[0], f"requires form a circle: {' -> '.join(cycle)}")
    batch = None
    if "global_batch" in data:
        bnode = {k.value: (k, v) for k, v in _mapping(root).items()}.get("global_batch", (None, None))
        batch = _load_batch(data["global_batch"], bnode, params, fail)
    rules = _load_rules(data.get("rules"), _mapping(root), params, fail)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Space(params=params, path=path, digest=digest, declared_batch=batch, rules=rules)


def _load_rules(spec: Any, top: dict, params: dict[str, Param], fail: Any) -> tuple[SpaceRule, ...]:
    """Read the ``rules:`` list (candidate/space_rules.py): each entry an expression, checked."""
    if spec is None:
        return ()
    node = next((v for k, v in top.items() if k.value == "rules"), None)
    if not isinstance(spec, list):
        raise fail(node, "rules: is a list of expressions a valid candidate makes true (- gpus % tp == 0)")
    items = node.value if isinstance(node, yaml.SequenceNode) else []
    out = []
    for i, text in enumerate(spec):
        try:
            out.append(SpaceRule.parse(text, {name: p.default for name, p in params.items()}))
        except RuleError as exc:
            raise fail(items[i] if i < len(items) else node, f"rules[{i}]: {exc}") from None
    return tuple(out)


def _read(path: Path) -> tuple[str, yaml.Node | None, Any]:
    """The file's text, its YAML node tree (for line numbers) and its data; one line on failure."""
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
    return text, root, data


def _load_param(name: Any, spec: Any, nodes: dict[str, Any], fail: Any) -> Param:
    """One entry of ``parameters:``, checked: its keys, type, choices or range, requires, default."""
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
            if not type_ok(ptype, c):
                raise fail(fields_.get("choices"), f"{name}.choices has {c!r}, not a {ptype}")
        if len(set(map(repr, choices))) != len(choices):
            raise fail(fields_.get("choices"), f"{name}.choices repeats a value")
    elif ptype in ("bool", "categorical"):
        raise fail(knode, f"{name}: a {ptype} parameter needs 'choices'")
    else:
        _check_range(name, ptype, spec, fields_, knode, fail)
    requires = spec.get("requires") or {}
    if not isinstance(requires, dict):
        raise fail(fields_.get("requires"), f"{name}.requires must map parameter names to values")
    memory = spec.get("memory")
    if memory is not None and memory not in ("up", "down", "none"):
        raise fail(
            fields_.get("memory", knode),
            f"{name}.memory is {memory!r}; allowed: up (a larger value needs more memory), down, none",
        )
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
        memory=memory,
    )
    if param.default is None:
        raise fail(knode, f"{name}: needs a 'default' (used when it is not searched)")
    if not param.contains(param.default):
        raise fail(fields_.get("default"), f"{name}.default {param.default!r} is not {param.allowed()}")
    return param


def _check_range(name: Any, ptype: str, spec: dict, fields_: dict, knode: Any, fail: Any) -> None:
    """A numeric parameter without choices: low and high of its type, a positive step, log scale."""
    for key in ("low", "high"):
        if not type_ok(ptype, spec.get(key)) and not (ptype == "float" and type_ok("int", spec.get(key))):
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


def _requires_cycle(params: dict[str, Param]) -> list[str]:
    """A chain of ``requires`` that comes back to where it started (no candidate satisfies it)."""
    for start in params:
        todo = [(dep, [start, dep]) for dep in params[start].requires]
        seen: set[str] = set()
        while todo:
            dep, chain = todo.pop()
            if dep == start:
                return chain
            if dep in seen or dep not in params:
                continue
            seen.add(dep)
            todo.extend((d, [*chain, d]) for d in params[dep].requires)
    return []


def _duplicate_key(node: yaml.Node | None) -> tuple[yaml.Node, str] | None:
    """The first key written twice in one mapping (YAML loaders keep the last one silently)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Node] = {}
        for key, value in node.value:
            if getattr(key, "value", None) in seen:
                first = seen[key.value]
                return key, f"'{key.value}' is written twice (first at line {first.start_mark.line + 1})"
            seen[getattr(key, "value", id(key))] = key
            found = _duplicate_key(value)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _duplicate_key(item)
            if found:
                return found
    return None


def _mapping(node: yaml.Node | None) -> dict:
    if isinstance(node, yaml.MappingNode):
        return {k: v for k, v in node.value}
    return {}
