"""Run one trial as an isolated process group and stop it cleanly.

Every trial gets its own session (``start_new_session``), so SIGTERM/SIGKILL reach the trainer and
everything it started (accelerate workers, vLLM engines) and nothing else (the killing itself is
:mod:`autotune.trial.processes`). Output is teed to the trial folder and handed to the caller line by
line while the process runs; the caller decides when enough has been measured. Timeouts and hangs
(no output for a while) end the trial here.

A trial's output is never trusted to be small or well formed: lines are cut, tails bounded, log
files capped and a full disk noted (:mod:`autotune.trial.streams`). The main loop works on lines in
slices, so a flood cannot hold off the timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from autotune.trial.cgroup import TrialCgroup, same_session
from autotune.trial.layout import TrialFiles
from autotune.trial.processes import (
    PID_FILE,
    TRIAL_ENV,
    kill_group,
    kill_marked,
    live_processes,
    process_tree,
)
from autotune.trial.streams import LOG_CAP, TrialOutput
from autotune.units import GIB

log = logging.getLogger(__name__)

__all__ = ["LaunchSpec", "LaunchResult", "ServiceFailed", "launch", "signals_held"]

TAIL_BYTES = 256 * 1024  # the last output kept in memory for the classifier, per tail
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


def _preexec(memory_limit_gib: float | None, cgroup_procs: str | None = None) -> Callable[[], None]:
    """Runs in the child between fork and exec: join the trial's cgroup (before it can start
    anything), die with the controller, cap memory if asked."""
    limit = int(memory_limit_gib * GIB) if memory_limit_gib else None

    def setup() -> None:
        if cgroup_procs:
            try:
                with open(cgroup_procs, "w") as procs:
                    procs.write("0")
            except OSError:  # the trial runs; launch() sees it outside the cgroup and says so
                pass
        try:  # if the controller is SIGKILLed, the trial leader goes too
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no glibc (musl, macOS): the trial outlives a killed controller
            pass
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return setup


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_held(*, replay: bool) -> Iterator[None]:
    """Hold off Ctrl-C, SIGTERM and SIGHUP while a trial's processes are being ended.

    The kill is SIGTERM, a grace, then SIGKILL: an interrupt raised inside the grace (two Ctrl-C
    0.2 s apart) skipped the SIGKILL and left a trainer that ignores SIGTERM running after the
    controller said "saved". A signal that comes meanwhile is noted and, with ``replay``, handed
    to its own handler once the kill is done (with an exception already on its way, the stop it
    asks for is under way, so it is dropped). Signals are only handled in the main thread: from
    another thread this holds nothing. Ignored signals stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    replaced: dict[signal.Signals, Any] = {}
    for sig in HELD_SIGNALS:
        if signal.getsignal(sig) not in (signal.SIG_IGN, None):
            replaced[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)
        if got and replay:
            handler = replaced[signal.Signals(got[0])]
            if callable(handler):
                handler(got[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


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
    cgroup = TrialCgroup.create(spec.trial_dir)
    proc = subprocess.Popen(
        spec.argv,
        env=env,
        cwd=spec.cwd or spec.trial_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_preexec(spec.memory_limit_gib, cgroup.procs_file if cgroup else None),
    )
    if cgroup is not None and proc.pid not in cgroup.pids() and proc.poll() is None:
        log.warning("trial %s did not join its cgroup %s", spec.trial_dir, cgroup.folder)
    try:
        (spec.trial_dir / PID_FILE).write_text(f"{proc.pid}\n")
    except OSError as exc:  # a full disk: the marker still finds the trial's processes on resume
        log.warning("cannot write %s: %s", spec.trial_dir / PID_FILE, exc)
    out = TrialOutput(proc, TrialFiles(spec.trial_dir), start, on_line, tail_bytes, log_cap_bytes)
    stopped: str | None = None
    tree: list[psutil.Process] = []

    def end_all(grace: float, *, replay: bool = True) -> None:
        with signals_held(replay=replay):  # a second Ctrl-C must not skip the SIGKILL
            # what it cannot shed: its cgroup, else its session (an env -i daemon has no marker)
            inside = cgroup.pids() if cgroup is not None else same_session(proc.pid)
            kill_group(proc.pid, tree[1:] + live_processes(inside), grace, leader=proc)
            kill_marked(marker, grace_s=min(grace, 2.0))
            if cgroup is not None and (left := cgroup.close(spec.trial_dir)):
                log.info("killed %d process(es) left in the cgroup of %s", left, spec.trial_dir)

    try:
        while proc.poll() is None:
            out.drain(0.1)
            tree = process_tree(proc.pid) or tree
            now = time.monotonic()
            last_output = out.last_active()
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
        if stopped is None and proc.returncode != 0 and should_stop() == "measured":
            # it died between two looks, after writing its last step (a rank aborting in its
            # teardown, reliability fault 30): one more look finds the steps the trial wanted
            stopped = "measured"
        # the leader is gone; anything left in its group, that it started, or that carries its
        # marker in another session (a setsid'd daemon holding our pipes) goes too
        end_all(min(grace_s, 2.0))
    except BaseException:
        # Ctrl-C, SIGTERM or an error in a callback: never leave the trial's processes behind
        tree = process_tree(proc.pid) or tree
        end_all(min(grace_s, 2.0), replay=False)  # the stop this exception carries is under way
        out.stop()
        raise
    out.finish(READERS_WAIT_S, FINAL_FEED_S, spec.trial_dir)
    (spec.trial_dir / PID_FILE).unlink(missing_ok=True)
    return LaunchResult(
        returncode=proc.returncode,
        stopped=stopped,
        wall_time_s=time.monotonic() - start,
        log_tail=out.tail.text(),
        stderr_tail=out.err_tail.text(),
        notes=out.notes(),
    )
