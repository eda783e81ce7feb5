"""Reading step figures from the dicts that trainers print on stdout.

:class:`LogParser` turns HF Trainer / TRL and ms-swift log dicts into :class:`StepRecord` objects,
the same records autotune's metrics file gives (:mod:`autotune.trial.metrics`).

**HF Trainer / TRL.** What is really printed (checked against trl 1.16 and transformers 5.23 as
installed, and by running a tiny GRPO on CPU):

- ``transformers.trainer_callback.ProgressCallback.on_log`` writes ``str(logs)`` through
  ``tqdm.write`` and ``PrinterCallback`` uses ``print(logs)``. In transformers 5 both first format
  every float as ``f"{v:.4g}"``, so the values are *quoted strings*:
  ``{'loss': '-0.198', 'grad_norm': '1.204', 'learning_rate': '1e-06', 'num_tokens': '41', ...,
  'step_time': '0.1953', 'epoch': '0.03333'}``. transformers 4 printed bare floats, and numpy
  scalars can show up as ``np.float64(0.1)``; all of these parse.
- The printed dict carries no ``step``: ``Trainer.log`` adds ``step`` only to
  ``state.log_history``. So steps are counted, ``logging_steps`` apart.
- ``step_time`` comes from ``GRPOTrainer.training_step``: the wall time of the
  ``gradient_accumulation_steps`` calls of ``training_step`` that make one optimizer step
  (generation included, since it happens inside ``_prepare_inputs``), summed and then averaged
  over the steps of the logging window. It does **not** include ``optimizer.step()``, gradient
  clipping or data loading, which the Trainer runs outside ``training_step``: with a CPU-offloaded
  optimizer that missing part can be seconds. When ``include_num_input_tokens_seen`` is on,
  every step dict also carries ``train_runtime`` (seconds since training began, i.e. a wall
  clock); it is kept as :attr:`StepRecord.elapsed` and ``steady_throughput`` prefers it.
- ``num_tokens`` (and ``num_input_tokens_seen``) are cumulative; per-step tokens are differences.
- The end-of-training dict (``train_runtime``, ``train_samples_per_second``,
  ``train_steps_per_second``, ``train_loss``) is not a step; it is kept in :attr:`LogParser.final`.

**ms-swift** (``swift/trainers/patcher.py`` in 4.x, ``swift/trainers/callback.py`` in 3.x): the HF
dict plus ``'global_step/max_steps': '3/100'``, ``'elapsed_time': '2m 23s'``, ``'remaining_time'``,
``'memory(GiB)'`` (the largest ``max_memory_reserved`` seen so far, in GiB) and a *cumulative*
speed. Up to 3.12.4 that is ``'train_speed(iter/s)' = global_step / seconds`` (until 3.7 the clock
started when the trainer was built, so the first interval includes setup); from 3.12.5 and in 4.x
it is ``'train_speed(s/it)' = seconds / (global_step - start_step)``. Either way a per-step time can
only come from the difference of two lines: ``elapsed_k = step_k / speed_k`` (or
``step_k * s_per_it_k``), and ``step_time = (elapsed_k - elapsed_{k-1}) / (step_k - step_{k-1})``.
ms-swift logs the first step and then every ``logging_steps`` (default 5), so one record usually
stands for several steps (:attr:`StepRecord.span`).

A metrics-contract dict printed on stdout (``{"step": 3, "step_time": 41.2, ...}``) is read too.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from autotune.trial.mapping import MAX_LITERAL_CHARS, parse_mapping
from autotune.trial.metrics import (
    MIN_STEP_S,
    PLAUSIBLE_STEP_S,
    Rejections,
    StepRecord,
    record_from_dict,
    to_float,
    to_int,
)
from autotune.units import duration_seconds

__all__ = ["LogParser", "parse_log_dicts"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# --------------------------------------------------------------------------------------------
# Finding dicts inside noisy lines
# --------------------------------------------------------------------------------------------


#: Characters of one ``\r`` segment searched for dicts; a log dict is a few KiB at most, and a
#: longer segment (a flood, a binary dump) is read only this far, so a line costs linear time.
MAX_SEGMENT_CHARS = 256 * 1024
#: Characters of candidate text handed to the parsers per segment, all attempts together: a line of
#: nested braces offers thousands of candidates, each of which could be tried at a linear cost.
PARSE_BUDGET_CHARS = 2**20

_BRACE_TOKENS = re.compile(r"""\\.|[{}'"]""", re.DOTALL)


def _brace_pairs(text: str) -> list[tuple[int, int]]:
    """(start, end) of every balanced ``{...}`` in ``text``, outer before inner, in one pass.

    Quotes count only inside braces (an apostrophe in the prose around a dict must not swallow
    it), and a backslash escapes the next character inside quotes. Only the characters that
    matter are visited (a regex finds them), so a 1 MB line costs a fraction of a second."""
    pairs: list[tuple[int, int]] = []
    stack: list[int] = []
    quote: str | None = None
    for match in _BRACE_TOKENS.finditer(text):
        token = match.group()
        if quote is not None:
            if token == quote:
                quote = None
            continue
        char = token[-1]
        if char in "'\"":
            if stack:
                quote = char
        elif char == "{":
            stack.append(match.start() + len(token) - 1)
        elif char == "}" and stack:
            pairs.append((stack.pop(), match.start() + len(token) - 1))
    pairs.sort()
    return pairs


def parse_log_dicts(line: str) -> list[dict[str, Any]]:
    """Every dict printed on one physical line, whatever surrounds it. Never raises.

    Real lines carry tqdm redraws separated by ``\\r``, ``[rank0]:`` or logger prefixes, ANSI
    colours and the odd second message glued on without a newline; each balanced ``{...}`` is
    tried on its own, outermost first, and when one does not parse, the dicts nested inside it are
    tried instead. The cost is linear in the line: the braces are matched in one pass
    (:func:`_brace_pairs`), and the text handed to the parsers is bounded by
    :data:`PARSE_BUDGET_CHARS` (a 30 KB line of nested braces once took 42 s here)."""
    found: list[dict[str, Any]] = []
    text = _ANSI.sub("", line) if "\x1b" in line else line
    for segment in text.split("\r"):
        if "{" not in segment:
            continue
        budget = PARSE_BUDGET_CHARS
        inside_until = -1  # end of the last dict found: what is inside it is not tried again
        for start, end in _brace_pairs(segment[:MAX_SEGMENT_CHARS]):
            if start < inside_until:
                continue
            size = end + 1 - start
            if size > MAX_LITERAL_CHARS:
                continue  # never parsed (see MAX_LITERAL_CHARS); a dict inside may be
            if size > budget:
                continue
            budget -= size
            parsed = parse_mapping(segment[start : end + 1])
            if parsed is not None:
                found.append(parsed)
                inside_until = end
    return found


# --------------------------------------------------------------------------------------------
# What kind of dict
# --------------------------------------------------------------------------------------------

_TRAIN_KEYS = (
    "loss",
    "step_time",
    "grad_norm",
    "global_step/max_steps",
    "train_speed(iter/s)",
    "train_speed(s/it)",
)
_FINAL_KEYS = ("train_loss", "train_samples_per_second", "train_steps_per_second")
_CONTRACT_KEYS = ("step_time", "samples", "tokens", "peak_memory_gib")


def _is_eval(d: dict[str, Any]) -> bool:
    return any(k.startswith(("eval_", "test_")) for k in d)


def _is_final(d: dict[str, Any]) -> bool:
    return "loss" not in d and any(k in d for k in _FINAL_KEYS)


def _is_contract_line(d: dict[str, Any]) -> bool:
    return (
        "step" in d
        and any(k in d for k in _CONTRACT_KEYS)
        and not any(k in d for k in ("loss", "grad_norm", "learning_rate", "epoch"))
    )


def _is_train_log(d: dict[str, Any]) -> bool:
    return any(k in d for k in _TRAIN_KEYS) or ("learning_rate" in d and "epoch" in d)


def _explicit_step(d: dict[str, Any]) -> int | None:
    progress = d.get("global_step/max_steps")
    if isinstance(progress, str) and "/" in progress:
        step = to_int(progress.split("/", 1)[0])
        if step is not None:
            return step
    for key in ("global_step", "step"):
        step = to_int(d.get(key))
        if step is not None:
            return step
    return None


# ms-swift's format_time always writes units ('2d 16h 57m 8s', '1m 5s', '34s'); a bare number is
# not its clock, although duration_seconds would read one as seconds.
_SWIFT_TIME = re.compile(r"\s*(?:\d+(?:\.\d+)?\s*[dhms]\s*)+")


def _clock(d: dict[str, Any], step: int) -> float | None:
    """Seconds since training began at ``step``, from whichever cumulative clock the dict has.

    The speeds are preferred: ms-swift rounds them to 6 decimals while ``elapsed_time`` is whole
    seconds."""
    speed = to_float(d.get("train_speed(iter/s)"))
    if speed is not None and speed > 0 and step > 0:
        return step / speed
    seconds_per_it = to_float(d.get("train_speed(s/it)"))
    if seconds_per_it is not None and seconds_per_it > 0 and step > 0:
        return seconds_per_it * step  # assumes the run did not resume (start_step == 0)
    runtime = to_float(d.get("train_runtime"))
    if runtime is not None and runtime > 0:
        return runtime
    elapsed = d.get("elapsed_time")
    return duration_seconds(elapsed) if isinstance(elapsed, str) and _SWIFT_TIME.fullmatch(elapsed) else None


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------


def _plausible_step(seconds: float | None, rejections: Rejections, where: str) -> float | None:
    """A step time a real optimizer step can have, else None (see :data:`PLAUSIBLE_STEP_S`), noted."""
    if seconds is None or MIN_STEP_S <= seconds <= PLAUSIBLE_STEP_S:
        return seconds
    side, bound = ("below", MIN_STEP_S) if seconds < MIN_STEP_S else ("above", PLAUSIBLE_STEP_S)
    rejections.add(f"{where} {seconds:g} s {side} {bound:g} s")
    return None


class LogParser:
    """Fed stdout/stderr lines live; returns a StepRecord when a line completes a step.

    ``logging_steps`` is the trainer's logging interval, used only when the printed dicts carry no
    step number (HF/TRL): the n-th dict is then step ``n * logging_steps``."""

    def __init__(self, logging_steps: int = 1) -> None:
        if logging_steps < 1:
            raise ValueError("logging_steps must be >= 1")
        self.logging_steps = logging_steps
        self.records: list[StepRecord] = []
        self.final: dict[str, Any] | None = None
        self._last_step = 0
        self._last_elapsed: float | None = None
        self._last_tokens: float | None = None
        self._peak: float | None = None
        self.rejections = Rejections()  # implausible values dropped, and why

    @property
    def peak_memory_gib(self) -> float | None:
        """Largest memory figure any line has reported, the final summary included."""
        return self._peak

    def feed(self, line: str) -> StepRecord | None:
        """Read one line; the last record it completed, if any."""
        last = None
        if "{" not in line:
            return None
        for d in parse_log_dicts(line):
            record = self._consume(d)
            if record is not None:
                last = record
        return last

    def _note_memory(self, d: dict[str, Any]) -> None:
        memory = to_float(d.get("memory(GiB)"))
        if memory is not None and memory >= 0:
            self._peak = memory if self._peak is None else max(self._peak, memory)

    def _consume(self, d: dict[str, Any]) -> StepRecord | None:
        if _is_eval(d):
            return None
        if _is_final(d):
            self._note_memory(d)
            self.final = {k: (to_float(v) if to_float(v) is not None else v) for k, v in d.items()}
            return None
        if _is_contract_line(d):
            record = record_from_dict(d, self.rejections)
            if record is None or (self.records and record.step <= self._last_step):
                return None
            self._last_step = record.step
            self.records.append(record)
            return record
        if not _is_train_log(d):
            return None
        self._note_memory(d)

        step = _explicit_step(d)
        if step is None:
            step = self._last_step + self.logging_steps
        if step <= self._last_step:  # a repeated line for a step already seen
            return None
        span = step - self._last_step

        elapsed = _clock(d, step)
        step_time = _plausible_step(to_float(d.get("step_time")), self.rejections, f"step {step}: step_time")
        if step_time is None and elapsed is not None:
            where = f"step {step}: step_time from the trainer's clock"
            if self._last_elapsed is not None:
                step_time = _plausible_step((elapsed - self._last_elapsed) / span, self.rejections, where)
            elif self._last_step == 0:
                step_time = _plausible_step(elapsed / span, self.rejections, where)

        tokens = None
        total = to_float(d.get("num_tokens"))
        if total is None:
            total = to_float(d.get("num_input_tokens_seen"))
        if total is not None:
            base = (
                self._last_tokens
                if self._last_tokens is not None
                else (0.0 if self._last_step == 0 else None)
            )
            if base is not None and total >= base:
                tokens = int(round((total - base) / span))
            self._last_tokens = total

        record = StepRecord(
            step=step,
            step_time=step_time,
            tokens=tokens,
            peak_memory_gib=self._peak,
            span=span,
            elapsed=elapsed,
        )
        self._last_step = step
        if elapsed is not None:
            self._last_elapsed = elapsed
        self.records.append(record)
        return record
