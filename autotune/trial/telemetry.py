"""Watching the GPUs and the host while a trial runs, and writing what was seen to gpu.csv.

The trainer's own metrics say how fast a trial went and how much memory *PyTorch* reserved; they do
not say whether the GPUs were busy, how much memory a colocated vLLM engine or the CUDA contexts
took, or how much host RAM an offloaded optimizer used. This module samples those from outside the
trial, a few times a second, with NVML (the library behind ``nvidia-smi``, see
:mod:`autotune.nvml`) and psutil.

:class:`GpuSampler` is a background thread started for one trial. Every tick it reads, for each
watched GPU, ``nvmlDeviceGetUtilizationRates(h).gpu`` (percent of the last sample period in which a
kernel ran) and ``nvmlDeviceGetMemoryInfo(h).used/.total`` (the whole device, so it counts the vLLM
engine and every process's CUDA context), and for the host the RSS and CPU percent summed over the
trial's process tree. Each reading is appended to ``trials/<n>/gpu.csv`` (flushed every tick, so a
trial that takes the machine down still leaves its samples) and kept for the summary
(:func:`autotune.trial.utilization.summarize`). Without NVML sampling falls back to psutil only and
the GPU columns stay empty.
"""

from __future__ import annotations

import csv
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from autotune.nvml import QUERY_ERRORS, close_nvml, handles, open_nvml
from autotune.trial.layout import GPU_CSV
from autotune.trial.processes import PID_FILE, process_tree
from autotune.trial.utilization import MEASURE, GpuReading, MonitorSummary, Tick, summarize
from autotune.units import GIB, KIB

log = logging.getLogger(__name__)

__all__ = ["CSV_NAME", "CSV_COLUMNS", "MEASURE", "GpuReading", "Tick", "GpuSampler"]

CSV_NAME = GPU_CSV  # the sampler's file, by its name in the trial folder's layout
CSV_COLUMNS = (
    "time_s",
    "phase",
    "gpu",
    "util_pct",
    "mem_used_gib",
    "mem_total_gib",
    "host_rss_gib",
    "host_cpu_pct",
)


def _peak_rss_bytes(pid: int) -> int | None:
    """The kernel's own peak resident set of one process (``VmHWM`` in /proc/<pid>/status, Linux),
    which a short allocation between two ticks cannot hide from; None where it is not readable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * KIB
    except (OSError, ValueError, IndexError):
        return None
    return None


class _HostTree:
    """RSS and CPU of a process and its descendants, keeping psutil objects between ticks.

    ``cpu_percent`` is measured since the previous call *on the same Process object*, so the objects
    must live across ticks; a process seen for the first time reports 0 once.
    RSS is summed, which double-counts pages shared between processes (forked DataLoader workers):
    a safe-side figure for "does the host have room", and cheap enough for several ticks a second,
    unlike PSS from smaps. ``peak_process_gib`` is the largest single process's peak RSS as the
    kernel counted it (``VmHWM``), read at each tick: the peak of a spike shorter than a tick.
    """

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}
        self.peak_process_gib: float | None = None

    def sample(self, root_pid: int | None) -> tuple[float | None, float | None]:
        if root_pid is None:
            return None, None
        members = process_tree(root_pid)
        rss = cpu = 0.0
        alive: dict[int, psutil.Process] = {}
        for proc in members:
            known = self.procs.get(proc.pid)
            if known is not None and known == proc:  # same pid and create time: not a recycled pid
                proc = known
            try:
                cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss
            except psutil.Error:
                continue
            alive[proc.pid] = proc
            hwm = _peak_rss_bytes(proc.pid)
            if hwm is not None:
                self.peak_process_gib = max(self.peak_process_gib or 0.0, hwm / GIB)
        self.procs = alive
        if not alive:
            return None, None
        return rss / GIB, cpu


class GpuSampler:
    """Samples the trial's GPUs and process tree in a background thread until :meth:`stop`.

    Start it before the trial is launched, so start-up memory (model load, vLLM profiling) is seen;
    give it the trial's pid with :meth:`set_root_pid` once known (until then, the launcher's
    ``trials/<n>/pid`` file is read each tick). ``mark("measure")`` when the measured steps begin
    and ``mark("end")`` when they are over, so the mean utilization covers exactly those steps.

    ``params`` and ``min_util`` feed the low-utilization diagnosis of :meth:`stop`.
    """

    def __init__(
        self,
        trial_dir: Path,
        gpu_indices: list[int] | None,
        root_pid: int | None = None,
        interval_s: float = 0.25,
        nvml: Any | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        min_util: float = 0.5,
    ) -> None:
        self.trial_dir = Path(trial_dir)
        self.gpu_indices = None if gpu_indices is None else list(gpu_indices)
        self.root_pid = root_pid
        self.interval_s = float(interval_s)
        self.params = dict(params or {})
        self.min_util = float(min_util)
        self.phase = "start"
        self.ticks: list[Tick] = []
        self._nvml_arg = nvml
        self._nvml: Any | None = None
        self._handles: dict[int, Any] = {}
        self._failed: set[tuple[int, str]] = set()
        self._host = _HostTree()
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()  # the thread's ticks and a caller's (sample before a kill)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._csv: Any | None = None
        self._writer: Any | None = None
        self._t0 = 0.0
        self._summary: MonitorSummary | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self) -> None:
        """Initialise NVML and the CSV without starting the thread (tests drive :meth:`tick`)."""
        if self._csv is not None:
            return
        self._nvml = open_nvml(self._nvml_arg)
        self._handles = handles(self._nvml, self.gpu_indices) if self._nvml is not None else {}
        self.trial_dir.mkdir(parents=True, exist_ok=True)
        self._csv = open(self.trial_dir / CSV_NAME, "w", newline="")
        self._writer = csv.writer(self._csv)
        self._writer.writerow(CSV_COLUMNS)
        self._csv.flush()
        self._t0 = time.monotonic()

    def start(self) -> GpuSampler:
        """Open and start sampling every ``interval_s`` seconds in a daemon thread."""
        self.open()
        self._thread = threading.Thread(target=self._run, name=f"gpumon-{self.trial_dir.name}", daemon=True)
        self._thread.start()
        return self

    def set_root_pid(self, pid: int | None) -> None:
        """The trial's leader pid: its process tree is what the host columns measure."""
        self.root_pid = pid

    def mark(self, phase: str) -> None:
        """Label the following samples (``measure`` = the steps whose utilization counts)."""
        with self._lock:
            self.phase = phase

    def stop(self, step_times: Mapping[str, float] | None = None) -> MonitorSummary:
        """Stop the thread, close NVML and the CSV, and summarise.

        ``step_times`` (see :func:`phase_times`) lets the diagnosis tell generation-bound trials
        apart; it is only known once the trial is over, hence here. Safe to call twice.
        """
        if self._summary is not None:
            return self._summary
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.interval_s))
            if self._thread.is_alive():
                log.warning("GPU sampler thread of %s did not stop in time", self.trial_dir)
        if self._csv is not None:
            if not self.ticks:  # a trial shorter than one interval still gets a sample
                self.tick()
            self._csv.close()
        close_nvml(self._nvml)
        self._summary = summarize(
            self.ticks,
            params=self.params,
            min_util=self.min_util,
            step_times=step_times,
            gpu_indices=list(self._handles),
            nvml=bool(self._handles),
            peak_process_rss_gib=self._host.peak_process_gib,
        )
        return self._summary

    def __enter__(self) -> GpuSampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- sampling -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # a sampling bug must not take the controller down with it
                log.exception("GPU sampling failed; sampling stops for %s", self.trial_dir)
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _pid(self) -> int | None:
        if self.root_pid is None:
            try:
                self.root_pid = int((self.trial_dir / PID_FILE).read_text().strip())
            except (OSError, ValueError):
                return None
        return self.root_pid

    def _read_gpu(self, index: int, handle: Any) -> GpuReading:
        nv = self._nvml
        util = used = total = None
        try:
            util = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except QUERY_ERRORS as exc:  # NVMLError_NotSupported on MIG slices, GpuIsLost, ...
            self._once(index, "util", exc)
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            used, total = mem.used / GIB, mem.total / GIB
        except QUERY_ERRORS as exc:
            self._once(index, "memory", exc)
        return GpuReading(index, util, used, total)

    def _once(self, index: int, what: str, exc: Exception) -> None:
        if (index, what) not in self._failed:
            self._failed.add((index, what))
            log.warning("NVML %s query failed on GPU %s (%s); leaving it empty", what, index, exc)

    def tick(self) -> Tick | None:
        """Take one sample now, append it to gpu.csv and keep it; None when nothing is measurable.

        Safe to call from another thread while sampling runs: the controller takes a last sample
        just before it stops a measured trial, whose peak may have come after the last tick."""
        with self._tick_lock:
            return self._tick()

    def _tick(self) -> Tick | None:
        with self._lock:
            phase = self.phase
        tick = Tick(
            round(time.monotonic() - self._t0, 3),
            phase,
            [self._read_gpu(i, h) for i, h in self._handles.items()],
        )
        tick.host_rss_gib, tick.host_cpu_pct = self._host.sample(self._pid())
        if not tick.gpus and tick.host_rss_gib is None:
            return None
        self.ticks.append(tick)
        if self._writer is not None and not self._csv.closed:
            self._writer.writerows(tick.rows())
            self._csv.flush()
        return tick
