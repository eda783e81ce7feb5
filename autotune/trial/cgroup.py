"""A trial's processes, found by something they cannot shed: a cgroup of their own.

The environment marker (:mod:`autotune.trial.processes`) misses a daemon started with ``env -i``,
and the process group misses one that calls ``setsid``. A cgroup is inherited by every process
the trainer starts, whatever it does to its environment, session or parents, and only root (or a
process owning the cgroup) can move out of it. So where the machine allows it (cgroup v2 mounted,
a folder under our own cgroup writable: root, or a delegated subtree), each trial runs in
``<our cgroup>/autotune-<pid>-<trial>``: the trial's leader joins it between fork and exec, so
there is no window in which a child escapes. Ending the trial ends everything listed in its
``cgroup.procs`` (``cgroup.kill`` where the kernel has it), then removes the folder. The folder's
path is written to ``trials/N/cgroup``, so a later ``resume`` finds what a crashed controller
left behind.

Where no cgroup can be made, :func:`same_session` finds what stayed in the trial's session (an
``env -i`` daemon that did not also call ``setsid``). What remains is documented in
docs/reliability.md: without cgroups, a daemon that clears its environment *and* leaves the
session is not found.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["TrialCgroup", "CGROUP_FILE", "same_session", "kill_recorded_cgroup"]

CGROUP_FILE = "cgroup"  # in the trial folder: the trial's cgroup folder while it may hold processes
NO_CGROUP_ENV = "AUTOTUNE_NO_CGROUP"  # set to 1 to run trials without a cgroup (the fallback path)


def _cgroup2_root() -> Path | None:
    """Where cgroup v2 is mounted (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid
    machine), from /proc/self/mountinfo; None without one."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return Path(left.split()[4])
    return None


def _own_cgroup() -> Path | None:
    """This process's cgroup v2 folder (the ``0::`` line of /proc/self/cgroup)."""
    root = _cgroup2_root()
    if root is None:
        return None
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                folder = root / line[3:].strip().lstrip("/")
                return folder if folder.is_dir() else None
    except OSError:
        return None
    return None


def _pids(folder: Path) -> list[int]:
    """The pids in a cgroup folder and its sub-folders (a trainer may make its own)."""
    pids: list[int] = []
    for procs in [folder / "cgroup.procs", *folder.glob("**/cgroup.procs")]:
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(pids))


def _kill_folder(folder: Path, timeout_s: float = 10.0) -> int:
    """SIGKILL every process of ``folder`` until it is empty, then remove it; how many there were.

    ``cgroup.kill`` kills them all at once, forks included; without it (kernels before 5.14) the
    pids are killed in rounds, which catches what they forked meanwhile."""
    first = _pids(folder)
    deadline = time.monotonic() + timeout_s
    while (left := _pids(folder)) and time.monotonic() < deadline:
        try:
            (folder / "cgroup.kill").write_text("1")
        except OSError:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.05)
    for sub in sorted(folder.glob("**/"), key=lambda p: len(p.parts), reverse=True):
        try:
            sub.rmdir()  # an empty cgroup folder is removed with rmdir; its files go with it
        except OSError as exc:
            log.debug("cannot remove cgroup %s: %s", sub, exc)
    return len(first)


@dataclass
class TrialCgroup:
    """The cgroup a trial's processes run in (see the module docstring)."""

    folder: Path

    @classmethod
    def create(cls, trial_dir: Path) -> TrialCgroup | None:
        """A new, empty cgroup for ``trial_dir``'s processes, recorded in the trial folder; None
        where the machine does not allow one (no cgroup v2, no right to write it, or
        ``AUTOTUNE_NO_CGROUP=1``)."""
        if os.environ.get(NO_CGROUP_ENV) == "1":
            return None
        own = _own_cgroup()
        if own is None:
            return None
        name = re.sub(r"[^\w.-]", "_", f"autotune-{os.getpid()}-{trial_dir.name}-{time.monotonic_ns()}")
        folder = own / name
        try:
            folder.mkdir()
            (trial_dir / CGROUP_FILE).write_text(f"{folder}\n")
        except OSError as exc:
            log.debug("no cgroup for %s: %s", trial_dir, exc)
            try:
                folder.rmdir()
            except OSError:
                pass
            return None
        return cls(folder)

    @property
    def procs_file(self) -> str:
        """Written with "0" by the trial's leader before exec: it joins the cgroup."""
        return str(self.folder / "cgroup.procs")

    def pids(self) -> list[int]:
        return _pids(self.folder)

    def close(self, trial_dir: Path) -> int:
        """Kill what is left in the cgroup, remove it and its record; how many processes were left."""
        left = _kill_folder(self.folder)
        if not self.folder.exists():
            (trial_dir / CGROUP_FILE).unlink(missing_ok=True)
        return left


def kill_recorded_cgroup(trial_dir: Path) -> bool:
    """Kill what a trial's recorded cgroup still holds (a crashed controller's trial); True if any.

    Only a folder that is a cgroup (it has ``cgroup.procs``) named by autotune is touched."""
    record = Path(trial_dir) / CGROUP_FILE
    try:
        folder = Path(record.read_text().strip())
    except OSError:
        return False
    if not folder.name.startswith("autotune-") or not (folder / "cgroup.procs").exists():
        record.unlink(missing_ok=True)
        return False
    left = _kill_folder(folder)
    if not folder.exists():
        record.unlink(missing_ok=True)
    return left > 0


def same_session(sid: int) -> list[int]:
    """Pids whose session is ``sid`` (field 6 of /proc/<pid>/stat): what stayed in a trial's
    session, marker or not. The trial's session id is its leader's pid (``start_new_session``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            found.append(int(entry.name))
    return found
