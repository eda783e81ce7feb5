"""Reading a whole trial log, bounded: the lines worth reading and their context, never all of it.

Why a module of its own: a log may be 64 MiB of progress bars with the root cause near its start;
:mod:`autotune.trial.classify` needs those lines, in order, in about a second. Parsing the trainer's
log dicts (:mod:`autotune.trial.logparse`) is another job.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path

__all__ = ["log_digest"]

log = logging.getLogger(__name__)

#: A log file is read whole up to this size; a longer one (launch caps them near 65 MiB) by its
#: first :data:`READ_HEAD` and last :data:`READ_END` bytes.
READ_HEAD = 72 * 2**20
READ_END = 8 * 2**20
LINE_KEEP = 16 * 1024  # characters of one line kept: its start and its end
CONTEXT_LINES = 60  # lines kept before a line worth reading (the traceback above it)
AFTER_LINES = 3  # and after it (an exception's message printed on the next line)
TAIL_LINES = 200  # the file's last lines, always kept
DIGEST_CHARS = 8 * 2**20  # past this, only lines matching ``priority`` are still kept (4x)
_READ_CHUNK = 2**20


def _file_lines(path: Path) -> Iterator[str]:
    """The lines of a log file, decoded leniently, each cut to :data:`LINE_KEEP` characters."""
    half = LINE_KEEP // 2
    size = path.stat().st_size
    spans = [(0, size)] if size <= READ_HEAD + READ_END else [(0, READ_HEAD), (size - READ_END, size)]
    with open(path, "rb") as fh:
        for number, (start, stop) in enumerate(spans):
            if number:
                yield f"[autotune: {start - READ_HEAD} bytes of this log not read]"
            fh.seek(start)
            left, carry, skip_first = stop - start, b"", number > 0
            while left > 0:
                chunk = fh.read(min(_READ_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                parts = (carry + chunk).split(b"\n")
                carry = parts.pop()
                if len(carry) > LINE_KEEP:  # a line longer than a chunk: keep its start and its end
                    carry = carry[:half] + carry[-half:]
                for raw in parts:
                    if skip_first:  # the end span starts mid-line
                        skip_first = False
                        continue
                    if len(raw) > LINE_KEEP:
                        raw = raw[:half] + b" ... " + raw[-half:]
                    yield raw.decode("utf-8", "replace")
            if carry and not skip_first:
                yield carry.decode("utf-8", "replace")


def log_digest(path: Path | str, worth: re.Pattern[str], priority: re.Pattern[str]) -> list[str]:
    """The lines of a log file that can decide a verdict, with their context, in order.

    A trial's log can be 64 MiB, and the line that matters (the first OOM) can sit anywhere in it.
    Every line is read (bounded, see :func:`_file_lines`), but only lines matching ``worth`` are
    kept, each with the :data:`CONTEXT_LINES` before it and :data:`AFTER_LINES` after it, plus the
    file's last :data:`TAIL_LINES`; a skipped run of lines leaves one marker line. Memory stays
    bounded: past :data:`DIGEST_CHARS` only ``priority`` lines are kept. A missing or unreadable
    file gives no lines."""
    kept: list[str] = []
    before: deque[tuple[int, str]] = deque(maxlen=CONTEXT_LINES)
    tail: deque[tuple[int, str]] = deque(maxlen=TAIL_LINES)
    last, after, chars = -1, 0, 0

    def keep(index: int, text: str) -> None:
        nonlocal last, chars
        if index > last + 1:
            kept.append(f"[autotune: {index - last - 1} lines not shown]")
        kept.append(text)
        last = index
        chars += len(text)

    try:
        for index, text in enumerate(_file_lines(Path(path))):
            tail.append((index, text))
            if worth.search(text) and (
                chars < DIGEST_CHARS or (chars < 4 * DIGEST_CHARS and priority.search(text))
            ):
                for prior in before:
                    keep(*prior)
                before.clear()
                after = AFTER_LINES + 1
            if after > 0:
                keep(index, text)
                after -= 1
            else:
                before.append((index, text))
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
    for index, text in tail:
        if index > last:
            keep(index, text)
    return kept
