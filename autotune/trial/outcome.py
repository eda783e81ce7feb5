"""What became of one trial: the ``outcome.json`` contract.

:class:`Outcome` is what ``trials/<n>/outcome.json`` holds (fixed contract: ``status``, ``oom_kind``,
``throughput``, ``peak_memory_gib``, ``mean_gpu_util``, ``error_line`` at least). Telling failures
apart from a trial's log is :mod:`autotune.trial.classify`'s job; this module only defines the
vocabulary (:class:`Status` and its groups, :data:`OOM_KINDS`), what each status means for the
search (:func:`describe`), and reading and writing the file.

``launched``, ``pruned``, ``predicted_gib`` and ``leftover_gib`` steer the search, so they are fields;
files written before they were (under ``extra``) are read into the fields.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from autotune.files import write_json

__all__ = ["STATUSES", "OOM_KINDS", "Status", "Outcome", "describe", "read_outcome"]

log = logging.getLogger(__name__)


class Status(StrEnum):
    """How a trial ended. String-valued: outcome.json, Optuna's user attributes and every report
    hold the plain strings, and a status compares equal to its string."""

    OK = "ok"
    OOM = "oom"
    INVALID = "invalid"
    SKIPPED = "skipped"
    TIMEOUT = "timeout"
    HANG = "hang"
    CRASH = "crash"
    INTERRUPTED = "interrupted"


STATUSES = tuple(s.value for s in Status)
#: Ended for a reason that says nothing about the configuration: not learned from, not an answer to a
#: repeat proposal, FAIL to Optuna (a crash is a bug or the environment; an interrupted trial runs again).
UNINFORMATIVE = frozenset({Status.CRASH, Status.INTERRUPTED})
#: Decided without running anything (a rule refused it, or the memory model did).
DECIDED = frozenset({Status.INVALID, Status.SKIPPED})
OOM_KINDS = ("cuda", "host", "vllm_kv", "vllm_startup")


@dataclass
class Outcome:
    """The result of one trial, as written to ``outcome.json``."""

    status: Status
    oom_kind: str | None = None
    throughput: float | None = None  # completions/s steady state
    peak_memory_gib: float | None = None
    mean_gpu_util: float | None = None
    error_line: str | None = None
    steps: int = 0  # optimizer steps seen
    step_times: list[float] = field(default_factory=list)
    wall_time_s: float | None = None
    returncode: int | None = None
    detail: str | None = None  # one-line human explanation
    launched: bool = False  # it ran as a trial (False: decided without a run, or a repeat)
    pruned: bool = False  # stopped early for being clearly slower than the best
    predicted_gib: float | None = None  # the planner's predicted peak before it ran
    leftover_gib: float | None = None  # a predecessor's memory still on the GPUs when it started
    # everything else, e.g. "rejected_metrics" (why reported values were not believed, the first
    # few) and "rejected_metrics_count", "memory_mention" (an OOM text in the log of a run that
    # succeeded), "previous_cleanup_failed" (a predecessor's cleanup failed), "log_notes" (a log
    # file capped or not written), "monitor"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of {', '.join(STATUSES)}")
        self.status = Status(self.status)
        if self.oom_kind is not None and self.oom_kind not in OOM_KINDS:
            raise ValueError(f"unknown oom_kind {self.oom_kind!r}; expected one of {', '.join(OOM_KINDS)}")
        if self.status != "oom" and self.oom_kind is not None:
            raise ValueError(f"oom_kind {self.oom_kind!r} given for status {self.status!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        out["step_times"] = [float(t) for t in self.step_times]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Outcome:
        """Read what :meth:`to_json` (or an older/newer writer) produced; unknown keys go to ``extra``,
        and the fields an older writer kept under ``extra`` come back as fields.

        A field of the wrong type (a hand-edited or damaged file) is a ValueError naming it, here,
        rather than an AttributeError wherever the value is used later."""
        if not isinstance(d, dict):
            raise ValueError(f"not a JSON object but {type(d).__name__}")
        if d.get("extra") is not None and not isinstance(d["extra"], dict):
            raise ValueError("extra: is of the wrong type")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        unknown = {k: v for k, v in d.items() if k not in known}
        if unknown:
            kwargs["extra"] = {**unknown, **(kwargs.get("extra") or {})}
        old = dict(kwargs.get("extra") or {})
        for name in _FORMERLY_EXTRA:
            if name in old:
                value = old.pop(name)
                kwargs.setdefault(name, value)
        if old != (kwargs.get("extra") or {}):
            kwargs["extra"] = old
        kwargs.setdefault("step_times", [])
        kwargs["step_times"] = list(kwargs["step_times"] or [])
        if kwargs.get("extra") is None:
            kwargs["extra"] = {}
        _check_types(kwargs)  # after the move out of ``extra``: an old file's fields are checked too
        return cls(**kwargs)

    def write(self, path: Path | str) -> None:
        """Write ``outcome.json`` atomically: a search killed mid-write must not leave half a file
        that ``autotune resume`` then chokes on. NaN and infinity are refused (ValueError)."""
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path | str) -> Outcome:
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


_FORMERLY_EXTRA = ("launched", "pruned", "predicted_gib", "leftover_gib")

_NUMBERS = ("throughput", "peak_memory_gib", "mean_gpu_util", "wall_time_s", "predicted_gib", "leftover_gib")
_TEXTS = ("error_line", "detail", "oom_kind")


def _check_types(d: dict[str, Any]) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    wrong = [k for k in _NUMBERS if d.get(k) is not None and not number(d[k])]
    wrong += [k for k in _TEXTS if d.get(k) is not None and not isinstance(d[k], str)]
    wrong += [k for k in ("steps", "returncode") if d.get(k) is not None and not isinstance(d[k], int)]
    wrong += [k for k in ("launched", "pruned") if d.get(k) is not None and not isinstance(d[k], bool)]
    if not isinstance(d.get("status"), str):
        wrong.append("status")
    if d.get("extra") is not None and not isinstance(d["extra"], dict):
        wrong.append("extra")
    times = d.get("step_times")
    if times is not None and not (isinstance(times, list) and all(number(t) for t in times)):
        wrong.append("step_times")
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: {'is' if len(wrong) == 1 else 'are'} of the wrong type")


_warned: set[str] = set()


def read_outcome(path: Path | str) -> Outcome | None:
    """A trial's outcome.json, or None when it is missing or damaged: the trial is then unknown.

    A damaged file (cut short, hand-edited, a field of the wrong type) is said once per process in
    one warning line and is never fatal: report, resume and show go on without that trial's file.
    """
    try:
        return Outcome.read(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        if str(path) not in _warned:
            _warned.add(str(path))
            log.warning("%s is damaged (%s): that trial is treated as unknown", path, str(exc)[:200])
        return None


_DETAILS = {
    ("oom", "cuda"): "GPU memory ran out: this configuration does not fit on the device",
    (
        "oom",
        "host",
    ): "host RAM ran out (offloaded state, pinned buffers, data loading) or the OOM killer ended the trial",
    (
        "oom",
        "vllm_kv",
    ): (
        "vLLM's memory share leaves too little for the KV cache: raise vllm_gpu_memory_utilization "
        "or shorten the sequences"
    ),
    (
        "oom",
        "vllm_startup",
    ): "vLLM asked for more GPU memory than the trainer left free: lower vllm_gpu_memory_utilization",
    ("invalid", None): "the trainer rejected this combination of settings before training",
    ("crash", None): "the trial failed with an error that is not about memory",
    ("timeout", None): "the trial ran past its time limit",
    ("hang", None): "the trial stopped producing output",
    ("interrupted", None): "the trial was stopped from outside",
    ("ok", None): "the trial completed its measurement",
}


def describe(status: str, oom_kind: str | None = None) -> str:
    """One line saying what a status means for the search (Outcome.detail)."""
    return _DETAILS.get((status, oom_kind if status == "oom" else None), status)
