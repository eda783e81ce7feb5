"""Where a study lives: ``runs/<name>/`` and its fixed layout (docs/trial-contract.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.errors import UsageError
from autotune.recipe import Recipe


@dataclass(frozen=True)
class StudyPaths:
    """The study folder: recipe.yaml, study.db, trials/<n>/, confirm/<n>/, verify/<n>/, best/."""

    runs_dir: Path
    name: str

    def __post_init__(self) -> None:
        # trials run with their own folder as cwd: every path handed to them must be absolute
        object.__setattr__(self, "runs_dir", Path(self.runs_dir).resolve())

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
