"""Writing files so that a crash never leaves half of one behind.

``autotune resume`` reads back everything a search wrote (outcome.json, params.json, recipe.yaml):
a controller killed in the middle of a write must leave the old file or the new one, never a torn
one. Every writer of those files goes through here. A full disk leaves no temporary file behind
and is reported against the file that was being written.

The temporary file is created private (``mkstemp`` makes it 0600); before it takes the file's name
it gets the mode any other new file would get under the user's umask, since people share runs
folders (a group-readable report.html stays group-readable).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), since threads
    write files concurrently; elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
            fh.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # name the file the user knows, not the temporary one that is gone already
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def write_json(path: Path | str, data: Any) -> None:
    """``data`` as indented JSON, atomically. NaN and infinity are refused (JSON has neither)."""
    write_text(path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
