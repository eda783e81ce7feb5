"""The run's checkpoints: ``runs/<study>/run/attempts/<n>/checkpoint-<step>``.

Every attempt of a production run writes into its own new folder, so a restart can never delete or
overwrite a checkpoint an earlier attempt saved: it only reads the newest one. A checkpoint the
trainer was killed while writing is not complete and is passed by (TRL/transformers write
``trainer_state.json`` into each checkpoint; a template trainer's checkpoint counts once it holds
any file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
HF_STATE = "trainer_state.json"
HF_FILES = ("model.safetensors", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    attempt: int = 0


def complete(folder: Path) -> bool:
    """Whether a trainer finished writing this checkpoint folder."""
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError:
        return False
    if HF_STATE in names:
        return True
    return bool(names) and not any(n in names for n in HF_FILES)  # TRL's, half written: not yet


def checkpoints(run_root: Path) -> list[Checkpoint]:
    """Every complete checkpoint any attempt saved (at any depth of its folder), oldest step first."""
    found: list[Checkpoint] = []
    for attempt in (run_root / "attempts").glob("*"):
        number = int(attempt.name) if attempt.name.isdigit() else 0
        for folder in attempt.rglob("checkpoint-*"):  # TRL: out/, ms-swift: out/v0-<date>/
            match = CHECKPOINT.match(folder.name)
            if match and folder.is_dir() and not CHECKPOINT.match(folder.parent.name) and complete(folder):
                found.append(Checkpoint(int(match.group(1)), folder.resolve(), number))
    return sorted(found, key=lambda c: (c.step, c.attempt))


def newest(run_root: Path) -> Checkpoint | None:
    """The checkpoint of the highest step (the latest attempt's, when two attempts saved it)."""
    found = checkpoints(run_root)
    return found[-1] if found else None
