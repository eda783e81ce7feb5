"""Python's parser, one thread at a time, and once more if another thread's parse still broke it.

CPython 3.11 (and 3.12 before 3.12.5) keeps the depth counter of the C-to-Python AST conversion
behind :func:`ast.parse` in interpreter-wide state, not per thread (CPython issue gh-106905). Two
threads that parse at once (two trials' launch threads each reading a printed dict in a parallel
search, or the main thread reading a space's rule meanwhile) can interleave inside that conversion
whenever a garbage collection runs Python code there, and one of them dies with ``SystemError: AST
constructor recursion depth mismatch``. CI saw it kill a parallel search. Every ``ast.parse`` in
autotune goes through :func:`parse`, which holds one lock; the texts are small, so the wait is
nothing. The lock cannot cover the standard library's own parses (Python 3.11's ``traceback`` parses
a failing line to place its ``^^^`` marks, so any thread that logs an exception does), and the
counter is set afresh when a parse starts, so a parse that still meets the error is run again.
Never call it from a finalizer or a signal handler: the lock is not re-entrant.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

__all__ = ["parse"]

_LOCK = threading.Lock()
_RACE = "recursion depth mismatch"  # CPython's words for gh-106905
ATTEMPTS = 5


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> Any:
    """:func:`ast.parse` under the process-wide lock; raises what ``ast.parse`` raises (the race's
    SystemError only if it came :data:`ATTEMPTS` times in a row)."""
    attempt = 1
    while True:
        with _LOCK:
            try:
                return ast.parse(source, filename, mode)
            except SystemError as exc:
                if _RACE not in str(exc) or attempt >= ATTEMPTS:
                    raise
        attempt += 1
