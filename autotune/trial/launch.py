"""Run one trial as an isolated process group and stop it cleanly.

Every trial gets its own session (``start_new_session``), so SIGTERM/SIGKILL reach the trainer and
everything it started (accelerate workers, vLLM engines) and nothing else (the killing itself is
:mod:`autotune.trial.processes`). Output is teed to the trial folder and handed to the caller line by
line while the process runs; the caller decides when enough has been measured. Timeouts and hangs
(no output for a while) end the trial here.

A trial's output is never trusted to be small or well formed: each stream is read in chunks, a line
longer than :data:`LINE_MAX` is cut to its first bytes, the in-memory tail is bounded in bytes
(:data:`TAIL_BYTES`), each log file keeps its first :data:`LOG_CAP` bytes, a note and its last
:data:`LOG_END` bytes (:class:`CappedLog`), and a log that cannot be written (disk full) is noted
while the output is still read and judged. The main loop works on lines in slices of
:data:`DRAIN_SLICE_S`, so a flood cannot hold off the timeout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import resource
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from autotune.trial.layout import TrialFiles
from autotune.trial.processes import PID_FILE, TRIAL_ENV, kill_group, kill_marked, process_tree
from autotune.units import GIB

log = logging.getLogger(__name__)

__all__ = ["LaunchSpec", "LaunchResult", "ServiceFailed", "CappedLog", "launch"]

CHUNK = 64 * 1024  # bytes read from a pipe at a time
LINE_MAX = 8 * 1024  # bytes of one line handed on; the rest of a longer line is dropped
TAIL_BYTES = 256 * 1024  # the last output kept in memory for the classifier, per tail
LOG_CAP = 64 * 2**20  # bytes of a stream written to its log file before it is capped
LOG_END = 2**20  # the last bytes of a capped stream, written after the note
QUEUE_LINES = 1024  # lines waiting for the main loop; a reader waits when it is full
DRAIN_SLICE_S = 0.2  # the longest the main loop hands lines on before it checks the clock
READERS_WAIT_S = 5.0  # after the trial ended: how long its pipes may stay open
FINAL_FEED_S = 2.0  # after the trial ended: how long left-over lines still go to on_line


class ServiceFailed(Exception):
    """A service a trial needs (a vLLM server) did not come up; carries its log for the verdict."""

    def __init__(self, message: str, returncode: int | None, log_text: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log_text = log_text


@dataclass
class LaunchSpec:
    """What to run for one trial: argv (no shell), extra environment, where."""

    argv: list[str]
    env: dict[str, str]
    trial_dir: Path
    cwd: Path | None = None
    memory_limit_gib: float | None = None  # RLIMIT_AS for the trial process (CPU OOM tests)
    sidecars: list[LaunchSpec] = field(default_factory=list)
    port: int | None = None  # a sidecar's TCP port (a vLLM server), picked per trial


@dataclass
class LaunchResult:
    returncode: int | None
    stopped: str | None  # why we stopped it: 'measured' | 'pruned' | 'timeout' | 'hang' | None
    wall_time_s: float
    log_tail: str  # last lines of stdout and stderr, in arrival order (bounded bytes)
    stderr_tail: str
    notes: list[str] = field(default_factory=list)  # a log that could not be written or was capped


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


def _preexec(memory_limit_gib: float | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: die with the controller, cap memory if asked."""
    limit = int(memory_limit_gib * GIB) if memory_limit_gib else None

    def setup() -> None:
        try:  # if the controller is SIGKILLed, the trial leader goes too
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no glibc (musl, macOS): the trial outlives a killed controller
            pass
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return setup


class CappedLog:
    """One stream's log file: the first ``cap`` bytes, then a note, then the last ``end`` bytes.

    A write that fails (disk full, folder gone) is noted once and the file is given up; the caller
    goes on reading the stream, so a full disk costs the log, not the trial's result.
    """

    def __init__(self, path: Path, cap: int = LOG_CAP, end: int = LOG_END) -> None:
        self.path, self.cap, self.end_keep = path, cap, end
        self.written = 0
        self.dropped = 0
        self.end: deque[bytes] = deque()
        self.end_size = 0
        self.error: str | None = None
        self.file: IO[bytes] | None = None
        try:
            self.file = open(path, "ab", buffering=0)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self.error = (
            f"{self.path.name} could not be written ({exc.strerror or exc}); its output was still read"
        )
        log.warning("%s", self.error)
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None

    def _write(self, data: bytes) -> None:
        if self.file is None:
            return
        try:
            self.file.write(data)
        except OSError as exc:
            self._failed(exc)

    def write(self, data: bytes) -> None:
        room = max(self.cap - self.written, 0)
        if room:
            self._write(data[:room])
            self.written += min(room, len(data))
            data = data[room:]
        if data:  # past the cap: keep the last ``end_keep`` bytes, in whole chunks (no copying)
            self.end.append(data)
            self.end_size += len(data)
            while self.end_size - len(self.end[0]) >= self.end_keep:
                first = self.end.popleft()
                self.end_size -= len(first)
                self.dropped += len(first)

    @property
    def note(self) -> str | None:
        if self.dropped:
            return (
                f"{self.path.name} capped at {self.cap} bytes: {self.dropped} bytes dropped, "
                f"the last {self.end_size} bytes kept"
            )
        return None

    def close(self) -> None:
        """Write what was held back (after a note when bytes were dropped) and close the file."""
        end = b"".join(self.end)
        self.end.clear()
        if self.dropped:
            end = end[max(len(end) - self.end_keep, 0) :]
            cut = end.find(b"\n")  # the kept end starts at a line
            end = end[cut + 1 :] if 0 <= cut < len(end) - 1 else end
            self.dropped += self.end_size - len(end)
            self.end_size = len(end)
            self._write(f"\n[autotune] {self.note}\n".encode())
        self._write(end)
        if self.file is not None:
            try:
                self.file.close()
            except OSError as exc:
                self._failed(exc)
            self.file = None


class _Lines:
    """Splits a byte stream into lines of at most ``limit`` bytes (an over-long line is cut to its
    first ``limit`` bytes, the rest dropped up to its newline)."""

    def __init__(self, limit: int = LINE_MAX) -> None:
        self.limit = limit
        self.partial = bytearray()
        self.cutting = False

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        start = 0
        while start < len(data):
            newline = data.find(b"\n", start)
            stop = len(data) if newline < 0 else newline
            if not self.cutting:
                room = self.limit - len(self.partial)
                self.partial += data[start : min(stop, start + room)]
                if stop - start > room:
                    out.append(bytes(self.partial))
                    self.partial.clear()
                    self.cutting = True
            if newline < 0:
                break
            if not self.cutting:
                out.append(bytes(self.partial))
            self.partial.clear()
            self.cutting = False
            start = newline + 1
        return out

    def flush(self) -> list[bytes]:
        rest = [] if self.cutting or not self.partial else [bytes(self.partial)]
        self.partial.clear()
        return rest


def _reader(
    stream: IO[bytes],
    sink: CappedLog,
    name: str,
    lines: queue.Queue[tuple[str, str]],
    seen: list[float],
    stop: threading.Event,
) -> None:
    """Tee one output stream to ``sink`` and hand its lines to the launch loop, in bounded pieces.

    ``seen[0]`` is the time bytes last arrived (an over-long line is output too, not a hang). When
    the queue is full the reader waits, so the pipe fills and the trainer waits on its own writes.
    """
    splitter = _Lines()

    def hand_on(raw: bytes) -> bool:
        text = raw.decode("utf-8", "replace")
        # tqdm redraws with \r: the last segment is what a terminal would show
        for piece in text.replace("\r\n", "\n").rstrip("\n").split("\r"):
            if piece.strip():
                while True:
                    if stop.is_set():
                        return False
                    try:
                        lines.put((name, piece), timeout=0.2)
                        break
                    except queue.Full:
                        continue
        return True

    fd = stream.fileno()
    try:
        while True:
            try:
                chunk = os.read(fd, CHUNK)
            except OSError:
                break
            if not chunk:
                break
            seen[0] = time.monotonic()
            sink.write(chunk)
            if not all(hand_on(raw) for raw in splitter.feed(chunk)):
                return
        for raw in splitter.flush():
            hand_on(raw)
    finally:
        sink.close()
        stream.close()


class _Tail:
    """The last lines of a stream, at most ``limit`` bytes of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: deque[str] = deque()
        self.size = 0

    def append(self, text: str) -> None:
        self.lines.append(text)
        self.size += len(text) + 1
        while self.size > self.limit and len(self.lines) > 1:
            self.size -= len(self.lines.popleft()) + 1

    def text(self) -> str:
        return "\n".join(self.lines)


def launch(
    spec: LaunchSpec,
    *,
    on_line: Callable[[str, str], None],
    should_stop: Callable[[], str | None],
    trial_timeout_s: float,
    hang_timeout_s: float,
    activity: Callable[[], float] | None = None,
    grace_s: float = 10.0,
    tail_bytes: int = TAIL_BYTES,
    log_cap_bytes: int = LOG_CAP,
) -> LaunchResult:
    """Run ``spec`` to the end, or until ``should_stop`` names a reason, a timeout or a hang.

    ``on_line(stream, text)`` sees every output line as it arrives (at most :data:`LINE_MAX`
    bytes of each). ``activity()`` may return the time of other signs of life (e.g. the metrics
    file growing) so a quiet trainer is not a hang. When the trial ends, every process whose
    environment carries its ``AUTOTUNE_TRIAL_DIR`` is ended too, in whatever session it runs.
    """
    spec.trial_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    env.setdefault(TRIAL_ENV, str(spec.trial_dir))  # every process it starts carries the marker
    marker = Path(env[TRIAL_ENV])
    start = time.monotonic()
    proc = subprocess.Popen(
        spec.argv,
        env=env,
        cwd=spec.cwd or spec.trial_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_preexec(spec.memory_limit_gib),
    )
    try:
        (spec.trial_dir / PID_FILE).write_text(f"{proc.pid}\n")
    except OSError as exc:  # a full disk: the marker still finds the trial's processes on resume
        log.warning("cannot write %s: %s", spec.trial_dir / PID_FILE, exc)
    lines: queue.Queue[tuple[str, str]] = queue.Queue(maxsize=QUEUE_LINES)
    stop_readers = threading.Event()
    seen = [start]
    files = TrialFiles(spec.trial_dir)
    sinks = [CappedLog(path, cap=log_cap_bytes) for path in (files.stdout, files.stderr)]
    readers = [
        threading.Thread(target=_reader, args=(stream, sink, name, lines, seen, stop_readers), daemon=True)
        for stream, sink, name in ((proc.stdout, sinks[0], "stdout"), (proc.stderr, sinks[1], "stderr"))
    ]
    for t in readers:
        t.start()
    tail, err_tail = _Tail(tail_bytes), _Tail(tail_bytes)
    last_output = start
    stopped: str | None = None
    tree: list[psutil.Process] = []

    def drain(block_s: float, feed: bool = True) -> None:
        """Hand queued lines on for up to :data:`DRAIN_SLICE_S` (``feed`` False: to the tails only)."""
        nonlocal last_output
        try:
            stream, text = lines.get(timeout=block_s) if block_s > 0 else lines.get_nowait()
        except queue.Empty:
            return
        until = time.monotonic() + DRAIN_SLICE_S
        while True:
            last_output = time.monotonic()
            tail.append(text)
            if stream == "stderr":
                err_tail.append(text)
            if feed:
                on_line(stream, text)
            if time.monotonic() > until:
                return
            try:
                stream, text = lines.get_nowait()
            except queue.Empty:
                return

    def end_all(grace: float) -> None:
        kill_group(proc.pid, tree[1:], grace, leader=proc)
        kill_marked(marker, grace_s=min(grace, 2.0))

    try:
        while proc.poll() is None:
            drain(0.1)
            tree = process_tree(proc.pid) or tree
            now = time.monotonic()
            last_output = max(last_output, seen[0])
            if activity is not None:
                last_output = max(last_output, activity())
            reason = should_stop()
            if reason is None and now - start > trial_timeout_s:
                reason = "timeout"
            if reason is None and now - last_output > hang_timeout_s:
                reason = "hang"
            if reason:
                stopped = reason
                log.debug("stopping trial pid %s: %s", proc.pid, reason)
                kill_group(proc.pid, tree[1:], grace_s, leader=proc)
                break
        proc.wait()
        # the leader is gone; anything left in its group, that it started, or that carries its
        # marker in another session (a setsid'd daemon holding our pipes) goes too
        end_all(min(grace_s, 2.0))
    except BaseException:
        # Ctrl-C, SIGTERM or an error in a callback: never leave the trial's processes behind
        tree = process_tree(proc.pid) or tree
        end_all(min(grace_s, 2.0))
        stop_readers.set()
        raise
    # the pipes close once every holder is gone; a holder we could not find is not waited for
    deadline = time.monotonic() + READERS_WAIT_S
    feed_until = time.monotonic() + FINAL_FEED_S
    while any(t.is_alive() for t in readers) and time.monotonic() < deadline:
        drain(0.05, feed=time.monotonic() < feed_until)
    stop_readers.set()
    while not lines.empty():
        drain(0, feed=time.monotonic() < feed_until)
    for t in readers:
        t.join(timeout=0.5)
    if any(t.is_alive() for t in readers):
        log.warning(
            "trial %s: an output pipe is still held open by a process that is not the trial's", spec.trial_dir
        )
    (spec.trial_dir / PID_FILE).unlink(missing_ok=True)
    notes = [n for sink in sinks for n in (sink.error, sink.note) if n]
    return LaunchResult(
        returncode=proc.returncode,
        stopped=stopped,
        wall_time_s=time.monotonic() - start,
        log_tail=tail.text(),
        stderr_tail=err_tail.text(),
        notes=notes,
    )
