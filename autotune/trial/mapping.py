"""Reading one printed dict: JSON first, then a Python ``repr`` (what trainers print).

A Python repr is read by Python's own parser and a small evaluator that accepts only literals, so a
log line can never run code. Why a module of its own: the metrics file (:mod:`autotune.trial.metrics`)
and the trainers' log lines (:mod:`autotune.trial.logparse`) both go through it.
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from typing import Any

from autotune.pyparse import parse

__all__ = ["MAX_LITERAL_CHARS", "parse_mapping"]

#: Texts longer than this are not handed to Python's parser: its time and memory grow much faster
#: than a text's length, and no real log dict comes near (ms-swift's GRPO dicts are ~2 KiB).
MAX_LITERAL_CHARS = 64 * 1024

# Bare names that stand for values in printed dicts (Python's and JSON's spellings).
_NAMES: dict[str, Any] = {
    "None": None,
    "null": None,
    "True": True,
    "true": True,
    "False": False,
    "false": False,
    "nan": math.nan,
    "NaN": math.nan,
    "inf": math.inf,
    "Infinity": math.inf,
}


def _literal(node: ast.expr) -> Any:
    """The value of a literal node; ValueError for anything that is not plain data.

    Beyond :func:`ast.literal_eval` this reads nan/inf/null/true/false as names, and a call such as
    ``np.float64(0.1)`` or ``tensor(0.5, device='cuda:0')`` as its first positional argument: all of
    these appear in real logs. Tuples read as lists. Nothing is ever executed."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
        raise ValueError("unsupported constant")
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key_node, value_node in zip(node.keys, node.values):
            if key_node is None:
                raise ValueError("** in a dict")
            key = _literal(key_node)
            if not isinstance(key, (str, int, float)):
                raise ValueError("bad key")
            out[str(key)] = _literal(value_node)
        return out
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Name):
        if node.id in _NAMES:
            return _NAMES[node.id]
        return float(node.id)  # other spellings of inf/nan ('INF', 'Nan'); ValueError for the rest
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand) if isinstance(node.operand, (ast.Constant, ast.Name)) else None
        if isinstance(operand, bool) or not isinstance(operand, (int, float)):
            raise ValueError("sign on a non-number")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Call) and _is_dotted_name(node.func):
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise ValueError("*args in a call")
        return _literal(node.args[0]) if node.args else None
    raise ValueError(f"not a literal: {type(node).__name__}")


def _is_dotted_name(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


# Python's compiler warns about odd literals ('1x', '\\d') in the text it parses. Those are trial
# output, not autotune's code: say nothing. A filter set once, on a file name of our own, since
# warnings.catch_warnings is not thread-safe and logs are read from reader threads.
_SOURCE_NAME = "<trial log dict>"
for _category in (SyntaxWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category, module=re.escape(_SOURCE_NAME))


def _python_literal(text: str) -> Any:
    """The value of a Python-repr text, or None when it is too long, malformed or not plain data."""
    if len(text) > MAX_LITERAL_CHARS:
        return None
    try:
        return _literal(parse(text, _SOURCE_NAME, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, SystemError):
        return None  # SystemError: CPython 3.11's parser race, met again on every retry (pyparse)


def parse_mapping(text: str) -> dict[str, Any] | None:
    """A dict from JSON or a Python repr, or None. Never raises."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = _python_literal(text)
    return value if isinstance(value, dict) else None
