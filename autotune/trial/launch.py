"""Run one trial as an isolated process group and stop it cleanly.

Every trial gets its own session (``start_new_session``), so SIGTERM/SIGKILL reach the trainer and
everything it started (accelerate workers, vLLM engines) and nothing else (the killing itself is
:mod:`autotune.trial.processes`). Output is teed to the trial folder and handed to the caller line by
line while the process runs; the caller decides when enough has been measured. Timeouts and hangs
(no output for a while) end the trial here.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import psutil

from autotune.trial.processes import PID_FILE, kill_group, process_tree
from autotune.units import GIB

log = logging.getLogger(__name__)

__all__ = ["LaunchSpec", "LaunchResult", "ServiceFailed", "launch"]


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
    memory_limit_gib: float | None = None   # RLIMIT_AS for the trial process (CPU OOM tests)
    sidecars: list["LaunchSpec"] = field(default_factory=list)


@dataclass
class LaunchResult:
    returncode: int | None
    stopped: str | None          # why we stopped it: 'measured' | 'pruned' | 'timeout' | 'hang' | None
    wall_time_s: float
    log_tail: str                # last lines of stdout and stderr, in arrival order
    stderr_tail: str


def _preexec(memory_limit_gib: float | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: die with the controller, cap memory if asked."""
    limit = int(memory_limit_gib * GIB) if memory_limit_gib else None

    def setup() -> None:
        try:  # PR_SET_PDEATHSIG: if the controller is SIGKILLed, the trial leader goes too
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except Exception:
            pass
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return setup


def _reader(stream: IO[bytes], sink: Path, name: str, lines: "queue.Queue[tuple[str, str]]") -> None:
    """Tee one output stream to ``sink`` and hand its lines to the launch loop."""
    with open(sink, "ab", buffering=0) as out:
        for raw in iter(stream.readline, b""):
            out.write(raw)
            text = raw.decode("utf-8", "replace")
            # tqdm redraws with \r: the last segment is what a terminal would show
            for piece in text.replace("\r\n", "\n").rstrip("\n").split("\r"):
                if piece.strip():
                    lines.put((name, piece))
    stream.close()


def launch(spec: LaunchSpec, *, on_line: Callable[[str, str], None],
           should_stop: Callable[[], str | None], trial_timeout_s: float, hang_timeout_s: float,
           activity: Callable[[], float] | None = None, grace_s: float = 10.0,
           tail_lines: int = 200) -> LaunchResult:
    """Run ``spec`` to the end, or until ``should_stop`` names a reason, a timeout or a hang.

    ``on_line(stream, text)`` sees every output line as it arrives. ``activity()`` may return the
    time of other signs of life (e.g. the metrics file growing) so a quiet trainer is not a hang.
    """
    spec.trial_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    start = time.monotonic()
    proc = subprocess.Popen(
        spec.argv, env=env, cwd=spec.cwd or spec.trial_dir, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_preexec(spec.memory_limit_gib),
    )
    (spec.trial_dir / PID_FILE).write_text(f"{proc.pid}\n")
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    readers = [
        threading.Thread(target=_reader, args=(proc.stdout, spec.trial_dir / "stdout.log", "stdout", lines),
                         daemon=True),
        threading.Thread(target=_reader, args=(proc.stderr, spec.trial_dir / "stderr.log", "stderr", lines),
                         daemon=True),
    ]
    for t in readers:
        t.start()
    tail: deque[str] = deque(maxlen=tail_lines)
    err_tail: deque[str] = deque(maxlen=tail_lines)
    last_output = start
    stopped: str | None = None
    tree: list[psutil.Process] = []

    def drain(block_s: float) -> None:
        nonlocal last_output
        try:
            stream, text = lines.get(timeout=block_s)
        except queue.Empty:
            return
        while True:
            last_output = time.monotonic()
            tail.append(text)
            if stream == "stderr":
                err_tail.append(text)
            on_line(stream, text)
            try:
                stream, text = lines.get_nowait()
            except queue.Empty:
                return

    try:
        while proc.poll() is None:
            drain(0.1)
            tree = process_tree(proc.pid) or tree
            now = time.monotonic()
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
    except BaseException:
        # Ctrl-C or an error in a callback: never leave the trial's process group behind
        kill_group(proc.pid, process_tree(proc.pid)[1:], grace_s=min(grace_s, 2.0), leader=proc)
        raise
    proc.wait()
    # the leader is gone; anything left in its group (or that it started) goes too
    kill_group(proc.pid, tree[1:], grace_s=min(grace_s, 2.0))
    for t in readers:
        t.join(timeout=5)
    drain(0)
    while not lines.empty():
        drain(0)
    (spec.trial_dir / PID_FILE).unlink(missing_ok=True)
    return LaunchResult(
        returncode=proc.returncode, stopped=stopped, wall_time_s=time.monotonic() - start,
        log_tail="\n".join(tail), stderr_tail="\n".join(err_tail),
    )
