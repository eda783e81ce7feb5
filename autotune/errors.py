"""Errors that reach the user as one line.

Both are :class:`click.ClickException` subclasses, so the CLI prints them as one line with their
exit status and never as a traceback: :class:`UsageError` (``error: ...``, exit 2) for bad input,
whose message must say what is wrong and how to fix it, and :class:`SearchStopped` (``search
stopped: ...``, exit 1) for a search that ended early for a reason worth one line.

A full disk is the user's to fix (free space, or write elsewhere), so it is a :class:`UsageError`
too, found by :func:`no_space` wherever in an exception's chain it hides: an ``OSError`` ENOSPC
from our own writes, or SQLite's "database or disk is full" under Optuna's StorageInternalError.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import IO, Any

import click


class _OneLine(click.ClickException):
    prefix = "error"

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"{self.prefix}: {self.format_message()}", err=True, file=file)


class UsageError(_OneLine):
    """Bad input from the user (flags, files, names). The message is shown as is."""

    exit_code = 2


class SearchStopped(_OneLine):
    """The search ended early for a reason worth one line (repeated crash, nothing valid left)."""

    exit_code = 1
    prefix = "search stopped"


NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
SQLITE_FULL = "database or disk is full"


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or during (Optuna and SQLAlchemy wrap the
    sqlite3 error that says what really happened two levels down)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def no_space(exc: BaseException) -> tuple[bool, str | None]:
    """(whether ``exc`` comes from a full disk or quota, the file being written if known)."""
    for err in causes(exc):
        if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
            name = err.filename if isinstance(err.filename, str) else None
            return True, name
        if SQLITE_FULL in str(err):
            return True, None
    return False, None


def disk_full(where: object, fix: str) -> UsageError:
    """The one line for a full disk: where it happened and how to get past it."""
    return UsageError(f"no space left on device writing {where}: free space there, or {fix}")
