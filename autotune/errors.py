"""Errors that reach the user as one line.

Both are :class:`click.ClickException` subclasses, so the CLI prints them as one line with their
exit status and never as a traceback: :class:`UsageError` (``error: ...``, exit 2) for bad input,
whose message must say what is wrong and how to fix it, and :class:`SearchStopped` (``search
stopped: ...``, exit 1) for a search that ended early for a reason worth one line.
"""

from __future__ import annotations

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
