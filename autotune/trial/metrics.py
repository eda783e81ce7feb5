"""What a trial reports about its steps, and how fast that makes it.

Every source of step figures (autotune's metrics file here, trainer log dicts in
:mod:`autotune.trial.logparse`) ends up as the same :class:`StepRecord`: one optimizer step, or a
run of steps whose values are per-step averages.

**autotune's metrics file** is the fixed trial contract (``AUTOTUNE_METRICS_FILE``), one JSON object
a line: ``{"step": 3, "step_time": 41.2, "samples": 256, "tokens": 393216, "peak_memory_gib": 71.3}``.
Unknown fields are ignored and missing ones are ``None``. See :func:`parse_metrics_line`,
:func:`read_metrics_file` and :class:`MetricsTail`.

Lines are read by :func:`~autotune.trial.mapping.parse_mapping`, shared with the log parser: JSON
first, then a Python ``repr`` (what trainers print).

:func:`steady_throughput` turns records into completions per second after warm-up.

Everything here is pure parsing and arithmetic: no process handling, no GPU access.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.trial.mapping import parse_mapping

log = logging.getLogger(__name__)

# Bounds of a real GRPO optimizer step; a value outside them is a trainer's bug, not a measurement.
MIN_STEP_S = 1e-3  # no optimizer step of a language model takes under a millisecond
PLAUSIBLE_STEP_S = 1e6  # nor over eleven days
PLAUSIBLE_SAMPLES = 10**7  # completions in one step
PLAUSIBLE_STEPS = 10**9
PLAUSIBLE_GIB = 1e5  # memory of one device or host, GiB

__all__ = [
    "Rejections",
    "StepRecord",
    "MetricsTail",
    "parse_metrics_line",
    "read_metrics_file",
    "record_from_dict",
    "steady_throughput",
    "to_float",
    "to_int",
]


@dataclass
class StepRecord:
    """One optimizer step, or ``span`` consecutive steps ending at ``step`` (values then per step).

    ``elapsed`` is seconds since training began at the end of ``step`` when the source has a wall
    clock (ms-swift's cumulative speed, HF's per-step ``train_runtime``); it lets throughput be
    measured over a whole window without adding up rounding, and it includes the optimizer step
    that TRL's ``step_time`` leaves out.
    """

    step: int
    step_time: float | None = None  # seconds for one optimizer step
    samples: int | None = None  # completions trained in that step
    tokens: int | None = None
    peak_memory_gib: float | None = None
    span: int = 1
    elapsed: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The metrics-line form (contract fields only; unknown values omitted)."""
        out: dict[str, Any] = {"step": self.step}
        for key in ("step_time", "samples", "tokens", "peak_memory_gib"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


# --------------------------------------------------------------------------------------------
# Small value helpers
# --------------------------------------------------------------------------------------------


def to_float(value: Any) -> float | None:
    """A finite float from a log value (float, int, '0.0123', '3.00%'), else None."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        if isinstance(value, (int, float)):
            result = float(value)
        elif isinstance(value, str):
            result = float(value.strip().rstrip("%").strip())
        else:
            return None
    except (ValueError, OverflowError):  # '1e5x', or an integer of 400 digits
        return None
    return result if math.isfinite(result) else None


def to_int(value: Any) -> int | None:
    """A whole number from a log value; 256 and 256.0 (a JSON writer may emit floats), not 2.5."""
    number = to_float(value)
    if number is None:
        return None
    rounded = round(number)
    return int(rounded) if abs(number - rounded) < 1e-6 * max(1.0, abs(number)) else None


# --------------------------------------------------------------------------------------------
# autotune metrics lines
# --------------------------------------------------------------------------------------------


class Rejections:
    """Why values a trial reported were not believed: the first :data:`KEEP` reasons, and a count.

    A dropped step time changes which steps are measured, so ``outcome.json`` says what was
    dropped and why (``extra["rejected_metrics"]``), rather than leaving a throughput that seems
    to come from fewer steps than the trainer logged."""

    KEEP = 10

    def __init__(self) -> None:
        self.count = 0
        self.reasons: list[str] = []

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.reasons) < self.KEEP:
            self.reasons.append(reason)
            log.info("measurement rejected: %s", reason)


def _shown(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _plausible(
    d: dict[str, Any],
    key: str,
    value: float | int | None,
    low: float,
    high: float,
    rejections: Rejections | None,
    where: str,
    unit: str = "",
) -> float | int | None:
    """``value`` when within [low, high]; else None, with the reason noted when the key was given."""
    if value is not None and low <= value <= high:
        return value
    raw = d.get(key)
    if rejections is not None and raw is not None:
        if value is None:
            rejections.add(f"{where}{key} {_shown(raw)} is not a usable number")
        else:
            side, bound = ("below", low) if value < low else ("above", high)
            rejections.add(f"{where}{key} {_shown(value)}{unit} {side} {bound:g}{unit}")
    return None


def record_from_dict(d: dict[str, Any], rejections: Rejections | None = None) -> StepRecord | None:
    """A StepRecord from a metrics-contract dict; None without a usable ``step``.

    Values no real GRPO step can have are dropped, not kept: negative counts, a step faster than
    :data:`PLAUSIBLE_STEP_S` bounds allow (a step time of 1e-300 s would export a configuration
    at 1e301 completions/s), more completions in one step than any node trains. Each drop is noted
    in ``rejections`` with its reason."""
    step = _plausible(d, "step", to_int(d.get("step")), 0, PLAUSIBLE_STEPS, rejections, "")
    if step is None:
        return None
    where = f"step {step}: "
    return StepRecord(
        step=int(step),
        step_time=_plausible(
            d,
            "step_time",
            to_float(d.get("step_time")),
            MIN_STEP_S,
            PLAUSIBLE_STEP_S,
            rejections,
            where,
            " s",
        ),
        samples=_plausible(d, "samples", to_int(d.get("samples")), 0, PLAUSIBLE_SAMPLES, rejections, where),
        tokens=_plausible(
            d, "tokens", to_int(d.get("tokens")), 0, PLAUSIBLE_SAMPLES * 10**6, rejections, where
        ),
        peak_memory_gib=_plausible(
            d,
            "peak_memory_gib",
            to_float(d.get("peak_memory_gib")),
            0.0,
            PLAUSIBLE_GIB,
            rejections,
            where,
            " GiB",
        ),
    )


def parse_metrics_line(line: str, rejections: Rejections | None = None) -> StepRecord | None:
    """One metrics-file line -> StepRecord; None for blank, partial or foreign lines."""
    text = line.strip()
    if not text.startswith("{") or not text.endswith("}"):
        return None
    d = parse_mapping(text)
    return record_from_dict(d, rejections) if d is not None else None


def read_metrics_file(path: Path | str) -> list[StepRecord]:
    """All complete records of a metrics file; a missing file is empty, bad lines are skipped.

    The trial may be killed in the middle of a write, so the last line can be cut short: it simply
    fails to parse and is dropped."""
    try:
        data = Path(path).read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return []
    records = []
    for raw in data.decode("utf-8", errors="replace").splitlines():
        record = parse_metrics_line(raw)
        if record is not None:
            records.append(record)
    return records


class MetricsTail:
    """Reads a growing metrics file incrementally: each :meth:`poll` returns the new complete lines.

    A line is consumed only once its newline is written, so a writer caught mid-line is read on
    the next poll rather than lost."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.offset = 0
        self.records: list[StepRecord] = []
        self.rejections = Rejections()

    def poll(self) -> list[StepRecord]:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if size < self.offset:  # truncated or replaced: start over
            self.offset = 0
            self.records = []
        if size == self.offset:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read(size - self.offset)
        cut = chunk.rfind(b"\n")
        if cut < 0:
            return []
        self.offset += cut + 1
        new = []
        for text in chunk[:cut].decode("utf-8", "replace").splitlines():
            noted = self.rejections.count
            record = parse_metrics_line(text, self.rejections)
            if record is not None:
                new.append(record)
            elif text.strip() and self.rejections.count == noted:
                self.rejections.add(f"metrics line {_shown(text.strip())} is not a JSON object with a step")
        self.records.extend(new)
        return new


# --------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------


def _by_step(records: Iterable[StepRecord]) -> list[StepRecord]:
    """Records sorted by step, the last one seen winning for a repeated step."""
    latest: dict[int, StepRecord] = {}
    for record in records:
        latest[record.step] = record
    return [latest[s] for s in sorted(latest)]


def steady_throughput(
    records: list[StepRecord], warmup_steps: int, samples_per_step: int | None
) -> float | None:
    """Completions per second after warm-up; None when there is not enough to say.

    ``sum(samples) / sum(step_time)`` over the steps after ``warmup_steps``, where a record without
    ``samples`` counts ``samples_per_step``. When every record after warm-up, and one at or before
    its end, carries a wall clock (``elapsed``), the time is taken from that clock instead: it
    includes what per-step timers leave out (TRL's ``step_time`` misses the optimizer step) and
    its rounding does not accumulate. A record spanning several steps is weighted by how many of
    its steps fall after warm-up."""
    recs = _by_step(records)
    post = [r for r in recs if r.step > warmup_steps]
    if not post:
        return None

    def per_step_samples(r: StepRecord) -> float | None:
        value = r.samples if r.samples is not None else samples_per_step
        return float(value) if value is not None and value > 0 else None

    if all(per_step_samples(r) is not None for r in post):
        before = [r for r in recs if r.step <= warmup_steps and r.elapsed is not None]
        if before and all(r.elapsed is not None for r in post):
            start = before[-1]
            wall = post[-1].elapsed - start.elapsed  # type: ignore[operator]
            steps = post[-1].step - start.step
            if wall > 0 and steps > 0:
                done = sum(per_step_samples(r) * min(r.span, r.step - start.step) for r in post)  # type: ignore[operator]
                return done / wall

    total_samples = 0.0
    total_time = 0.0
    for r in post:
        samples = per_step_samples(r)
        if samples is None or r.step_time is None or r.step_time <= 0:
            continue
        weight = min(max(r.span, 1), r.step - warmup_steps)
        total_samples += samples * weight
        total_time += r.step_time * weight
    if total_time <= 0 or total_samples <= 0:
        return None
    return total_samples / total_time
