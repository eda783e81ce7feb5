"""The trial folder's layout: the files of ``trials/<n>/`` and who writes them.

Why one module: the controller, the runners, the study's recovery, the export and the confirmation
runs all read or write these files, and a name spelled in each of them is a contract nobody can
change in one place. docs/trial-contract.md describes what each file holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "OUTCOME",
    "METRICS",
    "STDOUT",
    "STDERR",
    "GPU_CSV",
    "PARAMS",
    "COMMAND",
    "PID",
    "RUN_FILES",
    "TrialFiles",
]

OUTCOME = "outcome.json"  # how the trial ended (trial/outcome.py), written by the controller
METRICS = "metrics.jsonl"  # one JSON line per optimizer step, written by the trainer
STDOUT = "stdout.log"  # the trainer's standard output, teed and capped by trial/launch.py
STDERR = "stderr.log"  # the trainer's standard error, likewise
GPU_CSV = "gpu.csv"  # NVML/psutil samples (trial/telemetry.py), or the simulator's own timeline
PARAMS = "params.json"  # the candidate's parameter values, written before the launch
COMMAND = "command.txt"  # how to run the trial by hand: cwd, environment, argv
PID = "pid"  # the trial leader's pid while it runs (trial/processes.py finds its tree by it)

# what one run of the trial writes: a folder reused after an interruption loses these first, so
# the earlier run's lines are never read as this run's
RUN_FILES = (METRICS, STDOUT, STDERR, GPU_CSV, OUTCOME)


@dataclass(frozen=True)
class TrialFiles:
    """The paths of one trial folder's files (``trials/<n>/``, ``confirm/<n>/``, ``verify/<n>/``)."""

    dir: Path

    @property
    def outcome(self) -> Path:
        return self.dir / OUTCOME

    @property
    def metrics(self) -> Path:
        return self.dir / METRICS

    @property
    def stdout(self) -> Path:
        return self.dir / STDOUT

    @property
    def stderr(self) -> Path:
        return self.dir / STDERR

    @property
    def gpu_csv(self) -> Path:
        return self.dir / GPU_CSV

    @property
    def params(self) -> Path:
        return self.dir / PARAMS

    @property
    def command(self) -> Path:
        return self.dir / COMMAND

    @property
    def logs(self) -> list[Path]:
        """The trainer's logs, stderr first: where an error's own line is most likely to be."""
        return [self.stderr, self.stdout]

    def clear_run(self) -> None:
        """Remove what an earlier, interrupted run left (:data:`RUN_FILES`); inputs stay."""
        for name in RUN_FILES:
            (self.dir / name).unlink(missing_ok=True)
