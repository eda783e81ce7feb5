"""Between trials: back to the GPUs' baseline before the next trial starts.

A trial's memory is freed by the driver some time after its processes exit, and a straggler (a vLLM
worker, a DeepSpeed launcher child) can keep holding it. The next trial must start on GPUs as empty
as before the first one, or its OOMs would belong to its predecessor. :func:`read_baseline` records
what the GPUs hold before the first trial; :func:`wait_for_baseline` waits for that after each one
and, if waiting is not enough, kills what the trial left (only processes that are provably a
trial's, see :mod:`autotune.trial.processes`).

Without NVML there is nothing to measure: the baseline is None and the wait returns at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from autotune.nvml import QUERY_ERRORS, close_nvml, handles, memory_used_mib, open_nvml
from autotune.trial.processes import group_members, kill_group, owned_by_trial, protected_pids, wait_gone
from autotune.units import MIB_PER_GIB

log = logging.getLogger(__name__)

__all__ = ["read_baseline", "wait_for_baseline"]


def read_baseline(gpu_indices: Sequence[int] | None, nvml: Any | None = None) -> dict[int, float] | None:
    """Device memory used per GPU now, MiB, or None without NVML.

    Recorded once before the first trial: what the GPUs hold when none of ours runs (the display
    server, another user's job, the driver's own reservation).
    """
    nv = open_nvml(nvml)
    if nv is None:
        return None
    try:
        return memory_used_mib(nv, handles(nv, gpu_indices))
    finally:
        close_nvml(nv)


def _above(
    used: Mapping[int, float], baseline: Mapping[int, float], tolerance_mib: float
) -> dict[int, float]:
    """MiB above baseline + tolerance, per GPU that is."""
    return {i: used[i] - baseline[i] for i in used if i in baseline and used[i] > baseline[i] + tolerance_mib}


def _kill_leftovers(
    nvml: Any, gpu_handles: Mapping[int, Any], pgid: int | None, trial_dir: Path | None, grace_s: float
) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, what the trial left: its process group, and compute
    processes on our GPUs whose environment names a trial. Returns the pids signalled."""
    protected = protected_pids()
    victims: dict[int, psutil.Process] = {}
    members = [] if pgid is None or pgid <= 1 or pgid == os.getpgrp() else group_members(pgid)
    if pgid is not None and (pgid <= 1 or pgid == os.getpgrp() or any(p.pid in protected for p in members)):
        log.warning("refusing to signal process group %s: it holds this process or its parents", pgid)
        pgid = None  # its other members are still signalled one by one
    elif not members:
        pgid = None  # nothing left in it
    victims.update({p.pid: p for p in members if p.pid not in protected})
    for index, handle in gpu_handles.items():
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except QUERY_ERRORS as exc:
            log.debug("nvmlDeviceGetComputeRunningProcesses(%s) failed: %s", index, exc)
            continue
        for info in running:
            pid = int(getattr(info, "pid", 0) or 0)
            if pid <= 1 or pid in protected or pid in victims:
                continue
            proc = owned_by_trial(pid, trial_dir)
            if proc is not None:
                victims[pid] = proc
            else:
                log.info("GPU %s: process %s holds memory but is not a trial's; left alone", index, pid)
    if not victims:  # an empty group needs no signal; NVML listed nothing of ours
        return []
    log.warning(
        "killing what the last trial left on the GPUs: pids %s%s",
        sorted(victims),
        f" (process group {pgid})" if pgid is not None else "",
    )
    killed = kill_group(pgid, list(victims.values()), grace_s)
    if killed:
        wait_gone([p for p in killed if isinstance(p, psutil.Process)], grace_s)
    return sorted(victims)


def _trial_processes(nvml: Any, gpu_handles: Mapping[int, Any], trial_dir: Path | None) -> list[int]:
    """Pids of trial processes (by environment) NVML lists on these GPUs."""
    protected = protected_pids()
    pids = []
    for index, handle in gpu_handles.items():
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except QUERY_ERRORS as exc:
            log.debug("nvmlDeviceGetComputeRunningProcesses(%s) failed: %s", index, exc)
            continue
        pids += [
            int(info.pid)
            for info in running
            if int(info.pid) not in protected and owned_by_trial(int(info.pid), trial_dir) is not None
        ]
    return pids


def wait_for_baseline(
    gpu_indices: Sequence[int] | None,
    baseline_mib: Mapping[int, float] | None,
    timeout_s: float = 60,
    tolerance_gib: float = 1.0,
    pgid: int | None = None,
    nvml: Any | None = None,
    *,
    trial_dir: Path | None = None,
    poll_s: float = 0.5,
    grace_s: float = 5.0,
    settle_s: float = 15.0,
) -> bool:
    """Wait until every GPU's memory use is back within ``tolerance_gib`` of its baseline.

    The driver frees a dead process's memory with some delay, so first just wait up to ``timeout_s``.
    If that is not enough, something of the trial lives on: kill its process group ``pgid`` and any
    compute process NVML lists on these GPUs whose environment carries ``AUTOTUNE_TRIAL_DIR`` (equal
    to ``trial_dir`` or inside it, when given); processes without it are never touched, nor the
    caller and its ancestors. Then wait up to ``settle_s`` more. Returns whether the baseline was
    reached; False means the next trial would start with less memory (another job may have grown),
    which the caller should log. With ``baseline_mib`` None the test is "no trial process left on the GPUs".
    Without NVML there is nothing to measure and it returns True at once.
    """
    nv = open_nvml(nvml)
    if nv is None:
        return True
    if baseline_mib is not None:  # keys may come back from JSON as strings
        baseline_mib = {int(k): float(v) for k, v in baseline_mib.items()}
    try:
        gpu_handles = handles(nv, gpu_indices)
        tolerance_mib = tolerance_gib * MIB_PER_GIB

        def clean() -> bool:
            if baseline_mib is None:
                return not _trial_processes(nv, gpu_handles, trial_dir)
            return not _above(memory_used_mib(nv, gpu_handles), baseline_mib, tolerance_mib)

        def wait(limit_s: float) -> bool:
            deadline = time.monotonic() + limit_s
            while True:
                if clean():
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(poll_s)

        if wait(timeout_s):
            return True
        if baseline_mib is not None:
            over = _above(memory_used_mib(nv, gpu_handles), baseline_mib, tolerance_mib)
            log.warning(
                "GPU memory still above baseline after %.1f s: %s",
                timeout_s,
                ", ".join(f"GPU {i} +{mib / MIB_PER_GIB:.1f} GiB" for i, mib in sorted(over.items())),
            )
        _kill_leftovers(nv, gpu_handles, pgid, trial_dir, grace_s)
        reached = wait(settle_s)
        if not reached:
            log.warning("GPU memory did not return to baseline; the next trial starts with less free memory")
        return reached
    finally:
        close_nvml(nv)
