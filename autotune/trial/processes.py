"""Finding a trial's processes and killing them: the one place that scans and signals.

Every trial runs in its own session (see :func:`autotune.trial.launch.launch`), so its process
group holds the trainer and everything it started (accelerate workers, vLLM engines) and nothing
else. Killing a trial means SIGTERM to that group and to any descendant that left it, a grace
period, then SIGKILL to whatever is still there (:func:`kill_group`).

A trainer may also start a daemon that double-forks into a session of its own (``setsid``) and
ignores SIGTERM: it is in neither the group nor the tree, yet it holds the trial's output pipes and
outlives every later trial. Such processes are found by the environment marker wherever they run
(:func:`marked_processes`) and killed with the trial (:func:`kill_marked`), and again on resume
(:func:`kill_stale`).

A pid alone is never trusted: pids are recycled, and NVML reports processes of other users and
containers. A process counts as a trial's only when its environment carries ``AUTOTUNE_TRIAL_DIR``
(:data:`TRIAL_ENV`, set in every trial's environment, docs/trial-contract.md) naming that trial's folder
(:func:`owned_by_trial`, :func:`kill_stale`), and this process and its ancestors are never
signalled whatever their environment says (:func:`protected_pids`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from autotune.trial.cgroup import kill_recorded_cgroup
from autotune.trial.layout import PID

log = logging.getLogger(__name__)

__all__ = [
    "TRIAL_ENV",
    "PID_FILE",
    "process_tree",
    "group_members",
    "kill_group",
    "kill_stale",
    "owned_by_trial",
    "protected_pids",
    "inside",
    "signal_group",
    "wait_gone",
    "marked_processes",
    "kill_marked",
    "live_processes",
]

TRIAL_ENV = "AUTOTUNE_TRIAL_DIR"  # set in every trial's environment (docs/trial-contract.md)
PID_FILE = PID  # the trial leader's pid, in the trial folder while it runs

# How often a wait re-scans the process group: members may appear (a dying trainer forks a cleanup
# helper), and psutil's wait counts a zombie as running until someone reaps it, which may be never
# (PID 1 of a container often reaps nothing). Zombies are dropped between slices this short.
_RESCAN_S = 0.05


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (the process first); [] when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid`` that still run (zombies are dead, whoever reaps them)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (psutil.Error, OSError):
            continue
    return members


# How long a scan waits for a process caught inside execve(2) to get its environment (below).
_EXEC_WAIT_S = 5.0
_PF_KTHREAD = 0x00200000  # include/linux/sched.h: a kernel thread, which never has an environment


def _exec_under_way(pid: int) -> bool:
    """``pid`` is inside execve(2): its new image has no environment yet.

    The kernel records where a new image's environment lies (``env_end``, field 51 of
    /proc/<pid>/stat) at the very end of exec, after it has closed the close-on-exec descriptors
    that tell a parent's ``Popen`` the exec went through. So a pid can be printed, written to a
    pid file or found in a scan while /proc/<pid>/environ still reads empty: 11% of reads right
    after ``Popen`` returned on an idle machine here, 67% on a loaded one (docs/reliability.md).
    Kernel threads and the dead have no environment either, and are not waiting for one.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 49 or fields[0] in ("Z", "X", "x"):
        return False
    return int(fields[6]) & _PF_KTHREAD == 0 and fields[48] == "0"


def _trial_of(proc: psutil.Process) -> str | None:
    """The trial folder a process's environment names, or None (none, or unreadable).

    An empty environment is read again once the process is out of exec (:func:`_exec_under_way`):
    a trial's worker caught mid-exec would otherwise count as nobody's and survive its trial.
    """
    try:
        env = proc.environ()
        if not env:
            deadline = time.monotonic() + _EXEC_WAIT_S
            while _exec_under_way(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            env = proc.environ()
        return env.get(TRIAL_ENV)
    except (psutil.Error, OSError):
        return None


def inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies in it (as written, or once both are resolved)."""
    if path == folder or folder in path.parents:
        return True
    try:
        path, folder = path.resolve(), folder.resolve()
    except OSError:
        return False
    return path == folder or folder in path.parents


def owned_by_trial(pid: int, trial_dir: Path | None) -> psutil.Process | None:
    """The process if its environment marks it as a trial's, else None.

    With ``trial_dir`` the trial folder must be that folder or lie inside it, so a caller can
    claim one trial (``trials/7``) or every trial of its study (``trials``) and nobody else's.
    A pid NVML reports may belong to another user (environ: AccessDenied), to another container's
    pid namespace (NoSuchProcess here), or be recycled; all of those are foreign and left alone.
    """
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    owner = _trial_of(proc)
    if not owner:
        return None
    if trial_dir is not None and not inside(Path(owner), Path(trial_dir)):
        return None
    return proc


def protected_pids() -> set[int]:
    """Ourselves and our ancestors: never signalled, whatever their environment says."""
    pids = {os.getpid()}
    try:
        for parent in psutil.Process().parents():
            pids.add(parent.pid)
    except psutil.Error:
        pass
    return pids


def signal_group(pgid: int | None, procs: Sequence[psutil.Process], sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid`` (unless None) and to each of ``procs``; gone is fine."""
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except (psutil.Error, OSError):
            pass


def _running(proc: psutil.Process | subprocess.Popen) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _our_child(proc: psutil.Process | subprocess.Popen) -> bool:
    """A psutil handle on one of our own children: psutil's wait would reap it and steal the exit
    status from the ``subprocess.Popen`` that started it, so it is watched, not waited on."""
    if isinstance(proc, subprocess.Popen):
        return False
    try:
        return proc.ppid() == os.getpid()
    except psutil.Error:
        return False


def wait_gone(
    procs: Sequence[psutil.Process],
    timeout_s: float,
    pgid: int | None = None,
    leader: subprocess.Popen | None = None,
) -> list[psutil.Process | subprocess.Popen]:
    """Wait up to ``timeout_s`` until ``procs``, ``leader`` and the members of group ``pgid`` have
    exited; return those still running (empty when all are gone).

    ``leader`` is the caller's own ``Popen`` of a member: it is waited on through that object, which
    keeps its exit status. Zombies count as gone.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        watched: dict[int, psutil.Process | subprocess.Popen] = {}
        if pgid is not None:
            watched.update((p.pid, p) for p in group_members(pgid))
        watched.update((p.pid, p) for p in procs)
        if leader is not None:
            watched[leader.pid] = leader
        running = [p for p in watched.values() if _running(p)]
        remaining = deadline - time.monotonic()
        if not running or remaining <= 0:
            return running
        waitable = [p for p in running if not _our_child(p)]
        if waitable:
            psutil.wait_procs(waitable, timeout=min(remaining, _RESCAN_S))
        else:
            time.sleep(min(remaining, _RESCAN_S))


def kill_group(
    pgid: int | None,
    extra: Sequence[psutil.Process] | None = None,
    grace_s: float = 10.0,
    *,
    leader: subprocess.Popen | None = None,
) -> list[psutil.Process | subprocess.Popen]:
    """SIGTERM the group and ``extra`` (processes that may have left it), SIGKILL after ``grace_s``.

    Waits up to ``grace_s`` for the group's members and ``extra`` to die, then SIGKILLs the group
    and what survived. ``pgid`` None signals ``extra`` only. ``leader``: see :func:`wait_gone`; it
    is signalled through the group, never on its own. Returns the survivors that were SIGKILLed.
    """
    procs = list(extra or [])
    signal_group(pgid, procs, signal.SIGTERM)
    survivors = wait_gone(procs, grace_s, pgid, leader)
    if survivors:
        signal_group(pgid, [p for p in survivors if isinstance(p, psutil.Process)], signal.SIGKILL)
    return survivors


def live_processes(pids: Sequence[int]) -> list[psutil.Process]:
    """psutil handles on ``pids`` that still run, never this process or its ancestors."""
    protected = protected_pids()
    out = []
    for pid in pids:
        if pid in protected:
            continue
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return out


def marked_processes(trial_dir: Path) -> list[psutil.Process]:
    """Every live process whose environment names ``trial_dir`` (or a folder inside it).

    Found wherever it runs, so a daemon that left the trial's session is found too. This process
    and its ancestors never count, nor processes of other users (their environment is unreadable).
    """
    protected = protected_pids()
    found = []
    for proc in psutil.process_iter():
        if proc.pid in protected:
            continue
        owner = _trial_of(proc)
        if owner and inside(Path(owner), Path(trial_dir)) and _running(proc):
            found.append(proc)
    return found


def kill_marked(trial_dir: Path, grace_s: float = 2.0, rounds: int = 3) -> list[psutil.Process]:
    """SIGTERM what :func:`marked_processes` finds, SIGKILL it after ``grace_s``; returns the victims.

    A process may start another while dying, so the scan is repeated (up to ``rounds`` times) until
    nothing marked is left.
    """
    victims: list[psutil.Process] = []
    for _ in range(rounds):
        procs = marked_processes(trial_dir)
        if not procs:
            break
        log.info(
            "ending %d process(es) of trial %s left running: pids %s",
            len(procs),
            trial_dir,
            sorted(p.pid for p in procs),
        )
        victims += procs
        kill_group(None, procs, grace_s)
        wait_gone(procs, grace_s)
    return victims


def kill_stale(trial_dir: Path) -> bool:
    """Kill what a trial left running (a controller died, or a daemon outlived it); True if any.

    The pid file of the trial (and of its sidecars, ``trial_dir/*/pid``) names a process group; the
    leader is usually gone (it dies with the controller), its group may not be. The group is only
    trusted through members that carry the trial folder in their environment, so a recycled pid
    belonging to someone else is never touched. Then every process marked as the trial's, in
    whatever session, is killed as well (:func:`kill_marked`).
    """
    trial_dir = Path(trial_dir)
    killed = kill_recorded_cgroup(trial_dir)  # an env -i daemon has no marker, but a cgroup
    for pid_file in [trial_dir / PID_FILE, *sorted(trial_dir.glob(f"*/{PID_FILE}"))]:
        try:
            pid = int(pid_file.read_text().strip())
        except (ValueError, OSError):
            pid_file.unlink(missing_ok=True)
            continue
        members = [
            p
            for p in group_members(pid)
            if p.pid not in protected_pids() and (owner := _trial_of(p)) and inside(Path(owner), trial_dir)
        ]
        if members:
            log.info("killing stale trial process group %s (%s)", pid, trial_dir)
            kill_group(pid, members, grace_s=5.0)
            killed = True
        pid_file.unlink(missing_ok=True)
    return bool(kill_marked(trial_dir, grace_s=5.0)) or killed
