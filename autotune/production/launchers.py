"""The production run's process: the study's runner, told how long to train, where to save and
where to resume.

The run is launched by the same runner that launched the trials, so it is what was measured:
TRL through autotune's worker with the exported ``GRPOConfig`` (the best/ launch.sh needs the
user's training script; the worker is the script the trials ran), ms-swift through its
``swift rlhf`` line, any other trainer through its ``--command`` template with ``{max_steps}``
set to ``--steps``. On top of the trial:

- TRL and ms-swift save a checkpoint every ``save_steps`` (``--save_strategy steps``) and get
  ``--resume_from_checkpoint`` on a restart;
- a template trainer saves into ``{trial_dir}`` (the attempt's folder) and reads the newest
  checkpoint from ``AUTOTUNE_RESUME_FROM``, and how often to save from ``AUTOTUNE_SAVE_STEPS``;
  every trainer gets both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.production.checkpoints import Checkpoint
from autotune.runners.base import Runner
from autotune.trial.launch import LaunchSpec

RESUME_ENV = "AUTOTUNE_RESUME_FROM"
SAVE_ENV = "AUTOTUNE_SAVE_STEPS"  # how often a template trainer should save
TRL_SPEC = "trial_spec.json"  # what the trl runner writes for the worker


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag value`` replaced, or appended when absent."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        if i + 1 < len(out):
            out[i + 1] = value
            return out
        out.append(value)
        return out
    return out + [flag, value]


def prepare_attempt(
    runner: Runner,
    params: dict[str, Any],
    attempt_dir: Path,
    number: int,
    *,
    steps: int,
    save_steps: int,
    resume: Checkpoint | None,
    memory_limit_gib: float | None,
) -> LaunchSpec:
    """The LaunchSpec of one attempt of the production run (see the module docstring)."""
    if runner.name == "sim":
        raise UsageError("a --runner sim study simulates GPUs: there is nothing to train in production")
    spec = runner.prepare(params, attempt_dir, number, steps)
    if runner.name == "trl":
        path = attempt_dir / TRL_SPEC
        data = json.loads(path.read_text(encoding="utf-8"))
        data["max_steps"] = int(steps)
        data["production"] = {
            "save_steps": int(save_steps),
            "resume_from_checkpoint": str(resume.path) if resume else None,
        }
        path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    elif runner.name == "swift":
        argv = set_flag(spec.argv, "--max_steps", str(steps))
        argv = set_flag(argv, "--save_strategy", "steps")
        argv = set_flag(argv, "--save_steps", str(save_steps))
        if resume is not None:
            argv = set_flag(argv, "--resume_from_checkpoint", str(resume.path))
        spec.argv = argv
    spec.env[SAVE_ENV] = str(save_steps)
    if resume is not None:
        spec.env[RESUME_ENV] = str(resume.path)
    if memory_limit_gib is not None:
        spec.memory_limit_gib = memory_limit_gib
    return spec
