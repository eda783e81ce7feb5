"""A trial's output: two pipes read by threads into capped log files, bounded tails and lines.

Why a module of its own: a trial's output is never trusted to be small or well formed, and the
care that takes (chunks, cut lines, capped files, a full disk, a flood) is a job apart from
starting and stopping the process (:mod:`autotune.trial.launch`).
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from autotune.trial.layout import TrialFiles

log = logging.getLogger(__name__)

__all__ = ["CappedLog", "TrialOutput", "CHUNK", "LINE_MAX", "LOG_CAP", "LOG_END"]

LOG_CAP = 64 * 2**20  # bytes of a stream written to its log file before it is capped

CHUNK = 64 * 1024  # bytes read from a pipe at a time
LINE_MAX = 8 * 1024  # bytes of one line handed on; the rest of a longer line is dropped
LOG_END = 2**20  # the last bytes of a capped stream, written after the note
QUEUE_LINES = 1024  # lines waiting for the main loop; a reader waits when it is full
DRAIN_SLICE_S = 0.2  # the longest the main loop hands lines on before it checks the clock


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


class TrialOutput:
    """The running trial's stdout and stderr: teed to their log files by reader threads, queued as
    lines, and handed on by :meth:`drain` in slices of :data:`DRAIN_SLICE_S`."""

    def __init__(
        self,
        proc: subprocess.Popen,
        files: TrialFiles,
        start: float,
        on_line: Callable[[str, str], None],
        tail_bytes: int,
        log_cap_bytes: int,
    ) -> None:
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue(maxsize=QUEUE_LINES)
        self.stop_readers = threading.Event()
        self.seen = [start]
        self.on_line = on_line
        self.sinks = [CappedLog(path, cap=log_cap_bytes) for path in (files.stdout, files.stderr)]
        self.readers = [
            threading.Thread(
                target=_reader,
                args=(stream, sink, name, self.lines, self.seen, self.stop_readers),
                daemon=True,
            )
            for stream, sink, name in (
                (proc.stdout, self.sinks[0], "stdout"),
                (proc.stderr, self.sinks[1], "stderr"),
            )
        ]
        for t in self.readers:
            t.start()
        self.tail, self.err_tail = _Tail(tail_bytes), _Tail(tail_bytes)
        self.last_output = start

    def last_active(self) -> float:
        """When output last arrived: a line handed on, or bytes a reader saw."""
        self.last_output = max(self.last_output, self.seen[0])
        return self.last_output

    def drain(self, block_s: float, feed: bool = True) -> None:
        """Hand queued lines on for up to :data:`DRAIN_SLICE_S` (``feed`` False: to the tails only)."""
        try:
            stream, text = self.lines.get(timeout=block_s) if block_s > 0 else self.lines.get_nowait()
        except queue.Empty:
            return
        until = time.monotonic() + DRAIN_SLICE_S
        while True:
            self.last_output = time.monotonic()
            self.tail.append(text)
            if stream == "stderr":
                self.err_tail.append(text)
            if feed:
                self.on_line(stream, text)
            if time.monotonic() > until:
                return
            try:
                stream, text = self.lines.get_nowait()
            except queue.Empty:
                return

    def stop(self) -> None:
        self.stop_readers.set()

    def finish(self, readers_wait_s: float, final_feed_s: float, trial_dir: Path) -> None:
        """After the trial ended: the pipes close once every holder is gone; a holder we could not
        find is not waited for. Lines still arriving go to the caller for ``final_feed_s``."""
        deadline = time.monotonic() + readers_wait_s
        feed_until = time.monotonic() + final_feed_s
        while any(t.is_alive() for t in self.readers) and time.monotonic() < deadline:
            self.drain(0.05, feed=time.monotonic() < feed_until)
        self.stop_readers.set()
        while not self.lines.empty():
            self.drain(0, feed=time.monotonic() < feed_until)
        for t in self.readers:
            t.join(timeout=0.5)
        if any(t.is_alive() for t in self.readers):
            log.warning(
                "trial %s: an output pipe is still held open by a process that is not the trial's", trial_dir
            )

    def notes(self) -> list[str]:
        """A log that could not be written or was capped, one line each."""
        return [n for sink in self.sinks for n in (sink.error, sink.note) if n]
