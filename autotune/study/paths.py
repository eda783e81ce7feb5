"""Where a study lives: ``runs/<name>/`` and its fixed layout (docs/trial-contract.md).

The name is the study's identity: the folder, and the Optuna study inside study.db, carry it.
Spellings of one folder (``base/`` from shell completion) must give one name, or a second study
would be started in the same database and write over trials/ and best/.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from autotune.errors import UsageError
from autotune.recipe import Recipe

NAME_MAX = 100  # a folder name, and the prefix of lock study names: well under NAME_MAX of filesystems
NAME_RE = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")


def study_name(text: str, what: str = "study name") -> str:
    """The study name ``text`` means: trailing slashes dropped; anything that is not a plain folder
    name (a path, a leading '-' that reads as a flag, too long) is one line naming the fix."""
    name = str(text).rstrip("/")
    if "/" in name:
        raise UsageError(
            f"{what} {text!r} is a path: give the study's folder name and its parent with "
            f"--runs-dir, e.g. --runs-dir {name.rsplit('/', 1)[0] or '/'} {name.rsplit('/', 1)[1]}"
        )
    if name in ("", ".", "..") or not NAME_RE.fullmatch(name):
        raise UsageError(
            f"{what} {text!r}: use letters, digits, '.', '_' and '-' only, not starting with '-' "
            "(it names a folder)"
        )
    if len(name) > NAME_MAX:
        raise UsageError(f"{what} of {len(name)} characters: use at most {NAME_MAX} (it names a folder)")
    return name


@dataclass(frozen=True)
class StudyPaths:
    """The study folder: recipe.yaml, study.db, trials/<n>/, confirm/<n>/, verify/<n>/, best/."""

    runs_dir: Path
    name: str

    def __post_init__(self) -> None:
        # trials run with their own folder as cwd: every path handed to them must be absolute
        object.__setattr__(self, "runs_dir", Path(self.runs_dir).resolve())
        object.__setattr__(self, "name", study_name(self.name))

    @property
    def root(self) -> Path:
        return self.runs_dir / self.name

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def db(self) -> Path:
        return self.root / "study.db"

    @property
    def best(self) -> Path:
        return self.root / "best"

    def trial_dir(self, number: int) -> Path:
        return self.root / "trials" / str(number)

    def confirm_dir(self, number: int) -> Path:
        return self.root / "confirm" / str(number)

    def storage_url(self, recipe: Recipe) -> str:
        return recipe.storage or f"sqlite:///{self.db.resolve()}"


def prepare_root(paths: StudyPaths) -> None:
    """Create the study folder, with an error that says what to do when runs/ is not writable."""
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        probe = paths.root / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"cannot write to {paths.root} ({exc.strerror}): choose another --runs-dir"
        ) from None
