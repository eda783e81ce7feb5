"""A space's own validity rules (``rules:``): expressions over its parameters and the node's GPUs.

A trainer in its own names has rules autotune cannot know. Megatron refuses a layout whose tensor x
pipeline parallel size does not divide the GPUs, or sequence parallelism without tensor parallelism.
Launched, each such candidate is a crash that says nothing about memory, and a search of a
NeMo-RL-style space spent most of its trials on them (docs/benchmarks-notes.md, thirty-ninth pass).
A rule states what a valid candidate makes true, in Python's expression syntax::

    rules:
      - gpus % (tensor_model_parallel_size * pipeline_model_parallel_size) == 0
      - sequence_parallel == false or tensor_model_parallel_size > 1

Names are the space's parameters and ``gpus`` (the node's, ``--gpus``); ``true``/``false`` are read
as booleans too. Arithmetic, comparisons, ``and``/``or``/``not``, ``in`` a list and ``x if c else
y`` are allowed, nothing else (no calls, attributes or subscripts): a rule is parsed and checked once
when the space loads and evaluated by walking its syntax tree, never by ``eval``. A parameter that
``requires`` dropped from a candidate takes its default, as its ``--command`` placeholder does. A
broken rule marks the candidate invalid before anything runs, like the built-in rules.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any

from autotune.pyparse import parse

GPUS = "gpus"
MAX_LENGTH = 500  # characters: a rule is a line of a space file, and Python's parser recurses
CONSTANTS = {"true": True, "false": False, "True": True, "False": False, "none": None, "None": None}
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
NODES = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.IfExp,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.List,
    ast.Tuple,
    *BINARY,
    *COMPARE,
    *UNARY,
)


class RuleError(ValueError):
    """A rule that cannot be read: its message says what to write instead."""


@dataclass(frozen=True)
class SpaceRule:
    """One ``rules:`` entry, parsed."""

    text: str
    tree: ast.Expression
    names: frozenset[str]

    @classmethod
    def parse(cls, text: Any, defaults: dict[str, Any]) -> SpaceRule:
        """Read one rule over parameters with these ``defaults``, or raise :class:`RuleError` naming
        what is wrong with it (also one that cannot be computed at the defaults: a type mismatch)."""
        if not isinstance(text, str) or not text.strip():
            raise RuleError(f"{text!r} is not an expression (write one as text, e.g. 'gpus % tp == 0')")
        if len(text) > MAX_LENGTH:
            raise RuleError(f"is {len(text)} characters long; write rules of at most {MAX_LENGTH}")
        clash = sorted(set(defaults) & ({GPUS} | set(CONSTANTS)))
        if clash:
            raise RuleError(
                f"a parameter named {clash[0]!r} cannot be told apart from the rules' own {clash[0]}"
            )
        try:
            tree = parse(text.strip(), mode="eval")
        except SyntaxError as exc:
            raise RuleError(f"{text!r} is not a Python expression ({exc.msg})") from None
        except (RecursionError, MemoryError, ValueError):
            raise RuleError(f"{text[:60]!r}... is nested too deeply to read") from None
        params = set(defaults)
        for node in ast.walk(tree):
            if not isinstance(node, NODES):
                raise RuleError(
                    f"{text!r}: {type(node).__name__} is not allowed (arithmetic, comparisons, "
                    "and/or/not, in [..] and x if c else y are)"
                )
            if isinstance(node, ast.Name) and node.id not in params | {GPUS} | set(CONSTANTS):
                raise RuleError(f"{text!r}: {node.id!r} is neither a parameter of this space nor {GPUS}")
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - set(CONSTANTS)
        try:
            _value(tree.body, {**defaults, GPUS: 1})
        except TypeError as exc:
            raise RuleError(f"{text!r} cannot be computed at the parameters' defaults ({exc})") from None
        except (ArithmeticError, ValueError, RecursionError):
            pass  # a division by zero at the defaults may be what the rule forbids
        return cls(text.strip(), tree, frozenset(names))

    def holds(self, values: dict[str, Any]) -> bool:
        """Whether a candidate (with every name the rule uses) keeps the rule; an expression that
        cannot be computed for it (a division by zero, a type mismatch) does not."""
        try:
            return bool(_value(self.tree.body, values))
        except (ArithmeticError, TypeError, ValueError, RecursionError):
            return False


def _value(node: ast.AST, values: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id] if node.id in values else CONSTANTS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e, values) for e in node.elts]
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_value(v, values) for v in node.values)
        return any(_value(v, values) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](_value(node.operand, values))
    if isinstance(node, ast.BinOp):  # on numbers only: a list times a large number is not a rule
        left, right = _value(node.left, values), _value(node.right, values)
        if not all(isinstance(x, int | float) for x in (left, right)):
            raise TypeError("arithmetic on a list or text")
        return BINARY[type(node.op)](left, right)
    if isinstance(node, ast.IfExp):
        return _value(node.body if _value(node.test, values) else node.orelse, values)
    if isinstance(node, ast.Compare):
        left = _value(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = _value(right_node, values)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    raise TypeError(type(node).__name__)  # parse() admits nothing else
