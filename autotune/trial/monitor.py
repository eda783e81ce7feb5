"""Watching a running trial: its metrics file and its log lines, merged into step records.

A trainer may write the metrics file of the trial contract (our TRL worker and the simulator do);
any other trainer is read from its stdout log dicts. The metrics file wins when it has data,
because it carries samples and peak memory that logs often lack.
"""

from __future__ import annotations

import time
from pathlib import Path

from autotune.trial.logparse import LogParser
from autotune.trial.metrics import MetricsTail, StepRecord


class TrialMonitor:
    """Step records of one trial, from whichever source the trainer provides."""

    def __init__(self, metrics_file: Path, samples_per_step: int | None) -> None:
        self.metrics = MetricsTail(metrics_file)
        self.parser = LogParser()
        self.samples_per_step = samples_per_step
        self.last_growth = 0.0

    def feed(self, stream: str, line: str) -> StepRecord | None:
        return self.parser.feed(line)

    def poll(self) -> None:
        if self.metrics.poll():
            self.last_growth = time.monotonic()

    @property
    def records(self) -> list[StepRecord]:
        records = self.metrics.records or self.parser.records
        if self.samples_per_step:
            for r in records:
                if r.samples is None:
                    r.samples = self.samples_per_step
        return records

    @property
    def steps(self) -> int:
        """Optimizer steps done: a log line may stand for several (ms-swift logs every 5)."""
        records = self.records
        return max((r.step for r in records), default=0)

    def last_activity(self) -> float:
        return self.last_growth

    def rejected(self) -> tuple[list[str], int]:
        """Why reported values were dropped as implausible (the first few reasons) and how many,
        from the metrics file and the log dicts together."""
        sources = (self.metrics.rejections, self.parser.rejections)
        reasons = [reason for source in sources for reason in source.reasons]
        return reasons[: self.metrics.rejections.KEEP], sum(source.count for source in sources)

    def rejected_line(self) -> str | None:
        """The error line of a trial left with no usable step time because its values were
        rejected (NaN, Infinity, negative): the reason itself, since the log's last line ("step 8
        done") says nothing and stderr.log may be empty."""
        reasons, count = self.rejected()
        if not count:
            return None
        shown = "; ".join(reasons[:2]) + ("; ..." if count > 2 else "")
        return f"no usable step time: {count} reported value(s) rejected ({shown})"

    def peak_memory_gib(self) -> float | None:
        peaks = [
            r.peak_memory_gib
            for r in self.metrics.records + self.parser.records
            if r.peak_memory_gib is not None
        ]
        return max(peaks) if peaks else None
