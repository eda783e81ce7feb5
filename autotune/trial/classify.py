"""Telling a failed trial's failures apart from its log.

:func:`classify_failure` reads the text a failed trial left behind and decides whether it ran out of
memory (and which memory), was rejected as an invalid configuration, or crashed for some other
reason. The distinction matters more than the wording: the search treats an OOM as "this much does
not fit" and an invalid trial as "never launch its like again", while a crash is not a memory
signal at all, and a repeated crash stops the search.

The texts recognised are the real ones, from the libraries' sources and real logs (the fixtures
under ``tests/data/logs`` say where each came from):

- **cuda**: PyTorch's ``CUDA out of memory. Tried to allocate ...`` (new and old wordings),
  ``torch.OutOfMemoryError`` / ``torch.cuda.OutOfMemoryError``, ``CUDA error: out of memory``
  (RuntimeError before torch 2.8, ``torch.AcceleratorError`` after), ``CUBLAS/CUDNN/CUSOLVER_STATUS_
  ALLOC_FAILED``, NCCL ``Cuda failure 'out of memory'``, vLLM's sleep allocator ``CUDA Error: out of
  memory at .../cumem_allocator.cpp:N``, and the ROCm / XPU / NPU / MPS spellings.
- **host**: ``DefaultCPUAllocator: can't allocate memory``, ``std::bad_alloc``, ``MemoryError``,
  ``[Errno 12] Cannot allocate memory``, Ray's ``OutOfMemoryError``, a DataLoader worker "killed by
  signal: Killed", ``CUDA error: out of memory`` from ``pin_memory``, and death by SIGKILL (-9/137,
  torchrun's ``Signal 9 (SIGKILL) received by PID`` / ``exitcode: -9``, accelerate's ``died with
  <Signals.SIGKILL: 9>``, bash's ``Killed``) when no error of its own explains it: the kernel's OOM
  killer leaves no traceback.
- **vllm_kv**: ``No available memory for the cache blocks``, ``... KV cache is needed, which is larger
  than the available KV cache memory``, ``... larger than the maximum number of tokens that can be
  stored in KV cache``: vLLM's fraction is too small.
- **vllm_startup**: ``Free memory on device ... on startup is less than desired GPU memory
  utilization``: vLLM's fraction is larger than what the trainer left free.

``invalid`` is TRL's (and ms-swift's) own refusal of a configuration: ``generation_batch_size (g)
must be divisible by num_generations (G)`` / ``by the global batch size``, ``GRPO requires at least
2 generations per prompt``, ``tensor_parallel_size (t) must divide world size (n) evenly``.

Precedence: one failure causes others (rank 0 runs out of memory, rank 1 reports a closed
connection or an NCCL watchdog timeout, torchrun raises ``ChildFailedError``; vLLM's ``Engine core
initialization failed. See root cause above.`` wraps the real error). The earliest memory or
configuration signal is the root cause and decides; known consequences never are, and for a plain
crash the error line is the last exception that is not one of them. The process's final
error (the last exception that is not a consequence) decides alone when no memory or
configuration signal lies in its traceback chain or after it: a memory text quoted earlier (a
prompt, a warning) then died of a ``ValueError`` is a crash with the ``ValueError``. A trial is
judged from its whole log files (:func:`diagnose_files`), since the teardown noise after the root cause can be
longer than any tail kept in memory.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.trial.failure_texts import (
    CHAINED,
    FATAL,
    PIN_MEMORY,
    ROOT_CAUSE_WORDS,
    RULES,
    SECONDARY_NAMES,
    SECONDARY_TEXT,
    SIGKILL,
    WORTH_READING,
    Rule,
)
from autotune.trial.logread import log_digest
from autotune.trial.outcome import describe

__all__ = ["Diagnosis", "classify_failure", "diagnose", "diagnose_files", "last_error_line"]

ERROR_LINE_MAX = 300


# --------------------------------------------------------------------------------------------
# Line handling
# --------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Prefixes that launchers put in front of a process's own output.
_PREFIXES = re.compile(
    r"""^(?:
        # torchrun / accelerate: [rank0]:
        \[(?:rank|Rank)\s*\d+\]:?\s?
        # vLLM / Ray: (EngineCore_DP0 pid=245)
      | \((?:[\w\-.]+)\s+pid=\d+(?:,\s*ip=[\w.:\-]+)?\)\s?
        # vLLM: ERROR 07-11 06:23:05 [core.py:700]
      | (?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s\d\d-\d\d\s[\d:.]+\s\[[^\]]+\]\s?
        # glog (c10d, torchrun): E0312 14:13:05.6 90211 api.py:869]
      | \[?[DIWEF]\d{3,4}\s[\d:.]+\s(?:\d+\s)?[\w./\-]+:\d+\]\s?
        # DeepSpeed: [2025-06-02 11:20:41,118] [INFO] [x.py:1:f]
      | \[\d{4}-\d\d-\d\d\s[\d:,.]+\]\s\[\w+\]\s\[[^\]]+\]\s?
        # docker compose: 2026-04-19 12:05:27.169 |
      | \d{4}-\d\d-\d\d\s[\d:.]+\s\|\s
    )""",
    re.VERBOSE,
)
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')
_EXCEPTION = re.compile(
    r"(?:^|(?<=\]\s)|(?<=\)\s)|(?<=:\s))"
    r"(?P<name>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Exceeded))"
    r"(?::\s?(?P<msg>.*)|\s*$)"
)
_LEADING_BAR = re.compile(r"^[^|\n]{0,40}?\d+%\|[^|]*\|\s*\d+/\d+\s*\[[^\]]*\]\s?")  # tqdm bar glued in front
_PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\[\d+:\d+(?::\d+)?<|(?:it/s|s/it)\]\s*$")


def _clean(line: str) -> str:
    """Drop colours, tqdm redraws and launcher prefixes; keep the process's own words."""
    line = _ANSI.sub("", line)
    if "\r" in line:
        parts = [p for p in line.split("\r") if p.strip()]
        line = parts[-1] if parts else ""
    line = _LEADING_BAR.sub("", line.rstrip())
    for _ in range(4):
        stripped = _PREFIXES.sub("", line, count=1)
        if stripped == line:
            break
        line = stripped
    return line


def _exception(line: str) -> tuple[str, str] | None:
    """(name, message) when the cleaned line is where a traceback names its exception.

    Indented lines are traceback source/frames (``    except MemoryError:``), never the exception."""
    if not line or line[0].isspace():
        return None
    match = _EXCEPTION.search(line)
    if match is None:
        return None
    return match.group("name"), (match.group("msg") or "").strip()


def _trim(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_LINE_MAX else text[: ERROR_LINE_MAX - 3].rstrip() + "..."


def _is_secondary(name: str | None, text: str) -> bool:
    short = (name or "").rsplit(".", 1)[-1]
    return short in SECONDARY_NAMES or bool(SECONDARY_TEXT.search(text))


@dataclass
class _Hit:
    index: int  # line number in the cleaned log
    rule: Rule
    kind: str | None


def _is_source_line(lines: list[str], index: int) -> bool:
    """Is this an indented line of a Python traceback (the code shown under a ``File`` frame)?

    ``raise ValueError("No available memory for the cache blocks. "`` is such a line: it quotes
    the message but is not the error, and its frame may belong to a handled exception."""
    if not lines[index][:1].isspace():
        return False
    for j in range(index - 1, max(-1, index - 8), -1):
        if _FRAME.match(lines[j]):
            return True
        if lines[j] and not lines[j][:1].isspace():
            return False
    return False


def _scan(lines: list[str]) -> list[_Hit]:
    hits: list[_Hit] = []
    for i, line in enumerate(lines):
        if not line or _is_source_line(lines, i):
            continue
        exc = None
        for rule in RULES:
            if not rule.regex.search(line):
                continue
            if rule.exception_only:
                exc = exc or _exception(line)
                if exc is None or exc[0] not in rule.exception_only:
                    continue
            kind = rule.kind
            if (
                kind == "cuda"
                and "out of memory" in line.lower()
                and "CUDA error" in line
                and _traceback_mentions(lines, i, PIN_MEMORY)
            ):
                kind = "host"  # cudaHostAlloc failed: page-locked *host* memory ran out
            hits.append(_Hit(i, rule, kind))
            break
    return hits


def _traceback_mentions(lines: list[str], index: int, pattern: re.Pattern[str]) -> bool:
    """Does the traceback that ends at ``index`` pass through code matching ``pattern``?"""
    for j in range(index - 1, max(-1, index - 60), -1):
        line = lines[j]
        if line.startswith("Traceback (most recent call last)"):
            return False
        in_traceback = bool(_FRAME.match(line)) or line[:1].isspace()
        if in_traceback and pattern.search(line):
            return True
    return False


def _error_text(lines: list[str], index: int) -> str:
    """The line at ``index`` as an error line: from its exception name on, joined with the next
    line when the exception was printed with its message on the following line."""
    line = lines[index]
    if "NCCL WARN" in line:  # host:pid:tid [dev] file.cc:N NCCL WARN <what>
        return _trim(line[line.index("NCCL WARN") :])
    exc = _exception(line)
    if exc is not None:
        name, msg = exc
        if not msg:
            following = next((text for text in lines[index + 1 : index + 4] if text.strip()), "")
            if re.search(r"\w", following) and not following.lstrip().startswith(("Traceback", "File ")):
                msg = following.strip()
        return _trim(f"{name}: {msg}" if msg else name)
    previous = next((lines[j] for j in range(index - 1, max(-1, index - 3), -1) if lines[j].strip()), "")
    prev_exc = _exception(previous)
    if prev_exc is not None and not prev_exc[1]:
        return _trim(f"{prev_exc[0]}: {line.strip()}")
    return _trim(line.strip())


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


def _lines(log_text: str) -> list[str]:
    return [_clean(raw) for raw in (log_text or "").split("\n")]


def _root(hits: list[_Hit]) -> tuple[str | None, int]:
    """Kind of the earliest hit, and the best line of that kind (most specific rule, then earliest)."""
    first = min(hits, key=lambda h: h.index)
    same = [h for h in hits if h.rule.category == first.rule.category and h.kind == first.kind]
    best = min(same, key=lambda h: (h.rule.rank, h.index))
    return first.kind, best.index


def _last_error(lines: list[str]) -> str | None:
    primary = secondary = fatal = None
    for i, line in enumerate(lines):
        exc = _exception(line)
        if exc is not None:
            if _is_secondary(exc[0], line):
                secondary = i
            else:
                primary = i
        elif FATAL.search(line):
            fatal = i
    for index in (primary, fatal, secondary):
        if index is not None:
            return _error_text(lines, index)
    for line in reversed(lines):
        if line.strip() and not _PROGRESS.search(line):
            return _trim(line.strip())
    return None


def last_error_line(log_text: str) -> str | None:
    """The line that best says why a process failed, for a failure that is not about memory.

    The last exception of the last traceback that is not a mere consequence of another failure
    (a launcher's ``ChildFailedError``, a peer's closed connection, an NCCL watchdog timeout);
    else the last fatal C++/signal message; else the last consequence; else the last line that
    is not a progress bar."""
    return _last_error(_lines(log_text))


def _has_primary_error(lines: list[str]) -> bool:
    for line in lines:
        exc = _exception(line)
        if exc is not None and not _is_secondary(exc[0], line):
            return True
        if exc is None and FATAL.search(line) and not _is_secondary(None, line):
            return True
    return False


@dataclass
class Diagnosis:
    """Everything :func:`diagnose` could tell from a failed trial's exit."""

    status: str  # "oom" | "invalid" | "crash"
    oom_kind: str | None
    error_line: str | None
    detail: str


def _final_error(lines: list[str]) -> int | None:
    """Index of the last exception (or fatal error) that is not a consequence of another failure:
    the one that ended the process."""
    for i in range(len(lines) - 1, -1, -1):
        exc = _exception(lines[i])
        if exc is not None and not _is_source_line(lines, i):
            if not _is_secondary(exc[0], lines[i]):
                return i
        elif FATAL.search(lines[i]) and not _is_secondary(None, lines[i]):
            return i
    return None


def _chain_start(lines: list[str], index: int) -> int:
    """First line of the traceback (or C++ abort message) that ends at ``index``, with the
    tracebacks chained before it ("During handling of the above exception", "The above exception
    was the direct cause of the following exception")."""
    start, j = index, index - 1
    while j >= 0:
        line = lines[j]
        if line.startswith("Traceback (most recent call last)"):
            start = k = j
            while k > 0 and not lines[k - 1].strip():
                k -= 1
            if k > 0 and CHAINED.search(lines[k - 1]):
                j = next(
                    (m for m in range(k - 2, max(-1, k - 400), -1) if lines[m].startswith("Traceback (")),
                    -1,
                )
                start = min(start, j) if j >= 0 else start
                continue
            return start
        if line.strip() and not line[:1].isspace() and not _FRAME.match(line) and not FATAL.search(line):
            return start  # a line outside any traceback (or C++ abort message) ends the block
        start, j = j, j - 1
    return start


def _decisive(parts: list[list[str]]) -> tuple[list[str], int] | None:
    """The final error (stream, line) when it decides alone: a crash whatever memory texts came
    before it.

    The first stream (in order of trust) that holds a final error of its own decides. A memory or
    configuration signal counts only within that error's traceback chain or after it; one earlier
    in the log, or in another stream, is a quotation (a prompt, a warning) when the process then
    died of another exception. With no final error of its own anywhere (the last one is a
    consequence: a launcher's teardown, a peer's closed connection) this gives None, and the
    earliest signal decides as before."""
    for lines in parts:
        final = _final_error(lines)
        if final is None:
            continue
        start = _chain_start(lines, final)
        if any(hit.index >= start for hit in _scan(lines)):
            return None
        return lines, final
    return None


def _judge(returncode: int | None, parts: list[list[str]], stopped_by_us: bool) -> Diagnosis:
    """The verdict over cleaned log lines, one list per stream in order of trust (stderr first).

    The process's final error (:func:`_decisive`) rules out memory texts it does not follow from;
    else the first stream holding a memory or configuration signal decides by its earliest one."""
    decided = _decisive(parts)
    if decided is not None:
        return Diagnosis("crash", None, _error_text(*decided), describe("crash"))
    for lines in parts:
        hits = _scan(lines)
        if hits:
            kind, index = _root(hits)
            status = min(hits, key=lambda h: h.index).rule.category
            return Diagnosis(
                status=status,
                oom_kind=kind if status == "oom" else None,
                error_line=_error_text(lines, index),
                detail=describe(status, kind),
            )
    # stdout first, stderr last: the last error of stderr (where tracebacks go) names a crash
    lines = [line for part in reversed(parts) for line in part]
    killed_line = next((line for line in reversed(lines) if SIGKILL.search(line)), None)
    killed = killed_line is not None or (returncode in (-9, 137) and not stopped_by_us)
    if killed and not _has_primary_error(lines):
        line = _trim(killed_line.strip()) if killed_line else f"killed by SIGKILL (exit code {returncode})"
        return Diagnosis("oom", "host", line, describe("oom", "host") + " (SIGKILL with no error of its own)")
    outside = returncode is not None and returncode < 0 and not stopped_by_us  # a user's, a timeout's
    if outside and not any(_exception(x) or FATAL.search(x) for x in lines):  # no error text at all:
        # its last line is a warning, not the cause (an H100 run's was transformers' resume warning)
        name = next((s.name for s in signal.Signals if s == -returncode), f"signal {-returncode}")
        return Diagnosis("crash", None, f"ended by {name} (exit code {returncode})", describe("crash"))
    return Diagnosis("crash", None, _last_error(lines), describe("crash"))


def diagnose(returncode: int | None, log_text: str, *, stopped_by_us: bool = False) -> Diagnosis:
    """Like :func:`classify_failure`, with a human detail line."""
    return _judge(returncode, [_lines(log_text)], stopped_by_us)


def classify_failure(
    returncode: int | None, log_text: str, *, stopped_by_us: bool = False
) -> tuple[str, str | None, str | None]:
    """(status, oom_kind, error_line) for a process that ended on its own without completing measurement.

    status is 'oom' (with its kind), 'invalid' (TRL's configuration ValueErrors: generation_batch_size
    divisibility, 'at least 2 generations', tensor_parallel_size must divide world size) or 'crash'.
    ``log_text`` is stdout and stderr together (order within each is what matters; interleaving of
    the two is tolerated).

    A bare exit code of -9/137 reads as the OOM killer. When the launcher itself killed the process
    (timeout, hang, measurement done), pass ``stopped_by_us=True``: then only what the log says
    counts (a SIGKILL that a child reported, torchrun's ``Signal 9 (SIGKILL) received by PID``,
    still does, since our own kill reaches the launcher, not its children)."""
    d = diagnose(returncode, log_text, stopped_by_us=stopped_by_us)
    return d.status, d.oom_kind, d.error_line


def diagnose_files(
    returncode: int | None, paths: Sequence[Path], *, fallback: str = "", stopped_by_us: bool = False
) -> Diagnosis:
    """:func:`diagnose` over whole log files (give stderr.log first, then stdout.log).

    The in-memory tail of a trial's output ends in whatever the other ranks printed while the job
    came down (hundreds of KiB of NCCL warnings, then torchrun's ``ChildFailedError``): the OOM
    that caused it all sits further up. So the files are read, each through :func:`log_digest`,
    and ``fallback`` (the tail) is used only when no file has anything."""
    parts = [[_clean(line) for line in log_digest(path, WORTH_READING, ROOT_CAUSE_WORDS)] for path in paths]
    parts = [part for part in parts if part]
    if not parts:
        return diagnose(returncode, fallback, stopped_by_us=stopped_by_us)
    return _judge(returncode, parts, stopped_by_us)
