"""Which ms-swift: the ``swift`` program a study uses and the version installed beside it.

ms-swift lives in an environment of its own (4.6.0 pins trl 0.29.1; ``bash scripts/swift_env.sh``
makes it). The program is ``--swift-bin``, else the one on PATH, else the one in
scripts/swift_env.sh's default venv; its interpreter (the script's shebang) tells the installed
version, and the flag names follow it (:class:`autotune.configs.swift.SwiftVersion`). The runner
checks it before the first trial; the export asks it which flag names swift.sh should use.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from autotune.configs.swift import SwiftVersion
from autotune.errors import UsageError
from autotune.recipe import Recipe

INSTALL_HINT = (
    "bash scripts/swift_env.sh makes its own environment (ms-swift pins trl 0.29.1, so install it "
    "with pip install ms-swift in a separate venv), then pass --swift-bin VENV/bin/swift"
)


def default_venv() -> Path:
    """Where scripts/swift_env.sh puts ms-swift unless ``AUTOTUNE_SWIFT_VENV`` says otherwise."""
    return Path(os.environ.get("AUTOTUNE_SWIFT_VENV") or Path.home() / ".cache" / "autotune" / "swift-venv")


def find_swift(recipe: Recipe) -> Path:
    """The ``swift`` program: ``--swift-bin``, PATH, then scripts/swift_env.sh's venv (UsageError if none)."""
    if recipe.swift_bin:
        given = Path(recipe.swift_bin).expanduser()
        found = (
            shutil.which(str(given))
            if os.sep not in str(given)
            else (str(given) if given.is_file() else None)
        )
        if not found or not os.access(found, os.X_OK):
            raise UsageError(f"--swift-bin {recipe.swift_bin}: no such program; {INSTALL_HINT}")
        return Path(found).absolute()
    on_path = shutil.which("swift")
    if on_path:
        return Path(on_path).absolute()
    venv_swift = default_venv() / "bin" / "swift"
    if venv_swift.is_file() and os.access(venv_swift, os.X_OK):
        return venv_swift.absolute()
    raise UsageError(f"--runner swift: no swift program found on PATH or in {default_venv()}; {INSTALL_HINT}")


def swift_python(program: Path) -> str:
    """The interpreter of the ``swift`` script, from its shebang (``#!/venv/bin/python``)."""
    try:
        with open(program, "rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise UsageError(f"cannot read {program}: {exc.strerror}; {INSTALL_HINT}") from None
    if first.startswith("#!"):
        words = shlex.split(first[2:])
        if words and Path(words[0]).name == "env" and len(words) > 1:
            found = shutil.which(words[-1])
            if found:
                return found
        elif words and os.access(words[0], os.X_OK):
            return words[0]
    beside = program.parent / "python"
    if beside.is_file():
        return str(beside)
    raise UsageError(f"{program} names no Python interpreter in its first line; {INSTALL_HINT}")


_VERSIONS: dict[str, SwiftVersion] = {}


def swift_version(python: str) -> SwiftVersion:
    """The ms-swift version installed for ``python`` (read once per interpreter)."""
    if python in _VERSIONS:
        return _VERSIONS[python]
    try:
        done = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('ms-swift'))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(
            f"cannot run {python} to read the ms-swift version ({exc}); {INSTALL_HINT}"
        ) from None
    version = SwiftVersion.parse(done.stdout.strip()) if done.returncode == 0 else None
    if version is None:
        raise UsageError(
            f"{python} has no ms-swift installed (importlib.metadata finds no 'ms-swift'); {INSTALL_HINT}"
        )
    _VERSIONS[python] = version
    return version
