"""Python's parser, one thread at a time.

CPython 3.11 (and 3.12 before 3.12.5) keeps the depth counter of the C-to-Python AST conversion
behind :func:`ast.parse` in interpreter-wide state, not per thread (CPython issue gh-106905). Two
threads that parse at once (a trial's stdout and stderr readers each reading a printed dict, or the
main thread reading a space's rule meanwhile) can interleave inside that conversion whenever a
garbage collection runs Python code there, and one of them dies with ``SystemError: AST constructor
recursion depth mismatch``. CI saw it kill a parallel search. Every ``ast.parse`` in autotune goes
through :func:`parse`, which holds one lock; the texts are small, so the wait is nothing.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

__all__ = ["parse"]

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> Any:
    """:func:`ast.parse` under the process-wide lock; raises what ``ast.parse`` raises."""
    with _LOCK:
        return ast.parse(source, filename, mode)
