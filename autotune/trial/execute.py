"""Running one launched trial and judging it: launch, watch, sample, classify, clean up.

The runner has already turned the candidate into a :class:`LaunchSpec`. Here the process runs in
its own group while its metrics and log lines are watched step by step (the trial's
:class:`TrialControl` says when enough is measured), NVML/psutil sample the GPUs and host into
gpu.csv, and afterwards what the trial reported and how it ended become an :class:`Outcome`.
The outcome is on disk before the slow part (waiting for the GPUs to drain), so a controller
killed during the cleanup resumes with the result instead of re-running the trial.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune.recipe import Recipe
from autotune.trial.classify import classify_failure, diagnose, diagnose_files
from autotune.trial.cleanup import read_baseline, wait_for_baseline
from autotune.trial.control import TrialControl
from autotune.trial.launch import LaunchResult, LaunchSpec, ServiceFailed, launch
from autotune.trial.layout import TrialFiles
from autotune.trial.metrics import steady_throughput
from autotune.trial.monitor import TrialMonitor
from autotune.trial.outcome import Outcome, Status
from autotune.trial.telemetry import GpuSampler
from autotune.trial.utilization import MonitorSummary, phase_times, summarize_file
from autotune.units import MIB_PER_GIB

log = logging.getLogger(__name__)


def fresh_trial_dir(trial_dir: Path) -> None:
    """Remove what an earlier, interrupted run left, so its lines are not fed to this one."""
    TrialFiles(trial_dir).clear_run()


def write_command(spec: LaunchSpec) -> None:
    """command.txt: how to run the trial by hand, environment and memory cap included."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items()))
    limit = f"# RLIMIT_AS {spec.memory_limit_gib} GiB\n" if spec.memory_limit_gib else ""
    TrialFiles(spec.trial_dir).command.write_text(
        f"{limit}cd {shlex.quote(str(spec.cwd or spec.trial_dir))}\n{env} \\\n  {shlex.join(spec.argv)}\n"
    )


# Set when the search stops abruptly (Ctrl-C, an error): trials running in other threads stop at
# their next poll, their processes killed, and stay unrecorded so that a resume runs them again.
ABORT = threading.Event()


class TrialAborted(Exception):
    """A trial stopped because the whole search was (see :data:`ABORT`)."""


@contextlib.contextmanager
def abort_on_error(pool: Any) -> Iterator[None]:
    """Around a thread pool of trials: when the main thread stops (Ctrl-C, SIGTERM, an error), the
    running trials stop too (their processes killed), the pool is waited for, and the flag is
    cleared for whatever runs next in this process."""
    try:
        yield
    except BaseException:
        ABORT.set()
        raise
    finally:
        pool.shutdown(wait=True)
        ABORT.clear()


_BASELINES: dict[tuple[int, ...], dict[int, float] | None] = {}
# GPUs whose last wait_for_baseline gave up: the next trial may start beside a predecessor's memory
_CLEANUP_FAILED: dict[tuple[int, ...], bool] = {}
LEFTOVER_TOLERANCE_GIB = 1.0  # what wait_for_baseline is given: above it, memory is a leftover


def baseline_for(gpus: list[int]) -> dict[int, float] | None:
    """GPU memory in use before this controller's first trial on these GPUs (read once)."""
    key = tuple(gpus)
    if key not in _BASELINES:
        _BASELINES[key] = read_baseline(gpus)
    return _BASELINES[key]


def leftover_gib(
    gpus: list[int],
    baseline: dict[int, float] | None,
    *,
    nvml: Any | None = None,
    previous_failed: bool = False,
    tolerance_gib: float = LEFTOVER_TOLERANCE_GIB,
) -> float | None:
    """GiB the GPUs hold above their baseline as a trial starts (the most of any GPU), or None.

    An OOM of a trial that started beside a predecessor's leftover memory says nothing about its
    own configuration, so the amount goes into its outcome for the search to judge. It is given
    when it passes the tolerance the cleanup uses, and always when the previous cleanup gave up
    (``previous_failed``); None without a baseline or NVML."""
    if baseline is None or not gpus:
        return None
    now = read_baseline(gpus, nvml=nvml)
    if now is None:
        return None
    base = {int(k): float(v) for k, v in baseline.items()}
    excess = max((now[i] - base[i] for i in now if i in base), default=0.0) / MIB_PER_GIB
    if excess > tolerance_gib or previous_failed:
        return round(max(excess, 0.0), 3)
    return None


def trial_gpus(spec: LaunchSpec) -> list[int]:
    """NVML indices of the GPUs a trial was given (CUDA_VISIBLE_DEVICES of its environment)."""
    visible = spec.env.get("CUDA_VISIBLE_DEVICES", "")
    return [int(d) for d in visible.split(",") if d.strip().isdigit()]


def execute(
    spec: LaunchSpec,
    params: dict[str, Any],
    recipe: Recipe,
    control: TrialControl,
    *,
    monitors_gpus: bool,
    services: contextlib.AbstractContextManager[Any],
) -> Outcome:
    """Launch ``spec`` and stop it once its throughput is measured (or it is pruned).

    ``services`` is entered just before the launch and left after it (a vLLM server the trial
    needs); it raises :class:`ServiceFailed` when it cannot start. Afterwards the GPUs are brought
    back to their baseline before the next trial.
    """
    trial_dir = spec.trial_dir
    files = TrialFiles(trial_dir)
    write_command(spec)
    monitor = TrialMonitor(files.metrics, control.samples_per_step)
    gpus = trial_gpus(spec) if recipe.device == "cuda" else []
    sampler = GpuSampler(trial_dir, gpus, params=params, min_util=recipe.min_util) if monitors_gpus else None
    baseline = baseline_for(gpus) if sampler is not None and gpus else None
    previous_failed = _CLEANUP_FAILED.get(tuple(gpus), False)
    leftover = gpus_as_found(trial_dir, gpus, baseline, previous_failed)
    watch = StopCheck(trial_dir, monitor, control, sampler)
    with contextlib.ExitStack() as around:
        try:
            around.enter_context(services)
        except ServiceFailed as exc:
            failed = service_failed(exc)
            note_leftover(failed, leftover, previous_failed)
            return failed
        if sampler is not None:
            sampler.start()
        try:
            result = launch(
                spec,
                on_line=monitor.feed,
                should_stop=watch,
                trial_timeout_s=recipe.trial_timeout_s,
                hang_timeout_s=recipe.hang_timeout_s,
                activity=monitor.last_activity,
            )
        finally:
            summary = (
                sampler.stop(step_times=phase_times(files.metrics, after_step=control.rule.warmup))
                if sampler
                else None
            )
    monitor.poll()
    if summary is None and not monitors_gpus:  # a trial that writes its own gpu.csv (the simulator)
        summary = summarize_file(
            files.gpu_csv,
            params=params,
            min_util=recipe.min_util,
            step_times=phase_times(files.metrics, after_step=control.rule.warmup),
        )
    outcome = judge(result, monitor, recipe, control.rule.warmup, trial_dir=trial_dir)
    note_leftover(outcome, leftover, previous_failed)
    if summary is not None:
        add_monitor_summary(outcome, summary, recipe.device)
        if outcome.extra.get("low_util"):
            log.info("%s: low GPU utilization: %s", trial_dir.name, summary.diagnosis)
    # on disk before anything slow: a controller killed from here on resumes with this result, and with
    # the first pair of its steps that the study pools (study.ranking.step_noise)
    outcome.launched = True
    outcome.extra["step_pair"] = control.first_pair
    outcome.write(files.outcome)
    if gpus and sampler is not None:
        drain(gpus, baseline, trial_dir)
    return outcome


def gpus_as_found(
    trial_dir: Path, gpus: list[int], baseline: dict[int, float] | None, previous_failed: bool
) -> float | None:
    """The memory a predecessor left on this trial's GPUs (see :func:`leftover_gib`), logged."""
    leftover = leftover_gib(gpus, baseline, previous_failed=previous_failed) if baseline is not None else None
    if leftover is not None:
        log.warning(
            "%s starts with %.1f GiB of GPU memory above the baseline%s",
            trial_dir.name,
            leftover,
            " (the last cleanup gave up)" if previous_failed else "",
        )
    return leftover


class StopCheck:
    """The launch's ``should_stop``: feeds each new step to the trial's control and says when the
    trial is measured or pruned (or raises :class:`TrialAborted` once the whole search stops)."""

    def __init__(
        self, trial_dir: Path, monitor: TrialMonitor, control: TrialControl, sampler: GpuSampler | None
    ) -> None:
        self.trial_dir, self.monitor, self.control, self.sampler = trial_dir, monitor, control, sampler
        self.seen = 0  # step records already handed to the control

    def __call__(self) -> str | None:
        if ABORT.is_set():
            raise TrialAborted(f"{self.trial_dir.name}: the search was stopped")
        self.monitor.poll()
        records = self.monitor.records
        for rec in records[self.seen :]:
            self.control.on_step(rec)
            if self.sampler is not None and rec.step == self.control.rule.warmup:
                self.sampler.mark("measure")
        if len(records) == self.seen:
            return None
        self.seen = len(records)
        verdict = self.control.decide(records, self.monitor.steps)
        if verdict and self.sampler is not None:
            self.sampler.mark("end")
            self.sampler.tick()  # the last look at the tree's memory before it is stopped
        return verdict


def service_failed(exc: ServiceFailed) -> Outcome:
    """The outcome of a trial whose vLLM server did not start (it never launched)."""
    status, oom_kind, error_line = classify_failure(exc.returncode, exc.log_text)
    return Outcome(
        status=status if status in (Status.OOM, Status.INVALID) else Status.CRASH,
        oom_kind=oom_kind,
        error_line=error_line or str(exc),
        detail=f"the vLLM server did not start: {exc}",
    )


def drain(gpus: list[int], baseline: dict[int, float] | None, trial_dir: Path) -> None:
    """Wait for the GPUs to return to their baseline; remember a failure for the next trial."""
    reached = wait_for_baseline(
        gpus, baseline, tolerance_gib=LEFTOVER_TOLERANCE_GIB, pgid=None, trial_dir=trial_dir.parent
    )
    _CLEANUP_FAILED[tuple(gpus)] = not reached


def note_leftover(outcome: Outcome, leftover: float | None, previous_failed: bool) -> None:
    """Record on the outcome what a predecessor left on the GPUs (see :func:`leftover_gib`)."""
    if leftover is not None:
        outcome.leftover_gib = leftover
    if previous_failed:
        outcome.extra["previous_cleanup_failed"] = True


def add_monitor_summary(outcome: Outcome, summary: MonitorSummary, device: str) -> None:
    """Fold what the GPU sampler saw into the outcome.

    NVML's peak counts what the allocator does not (the CUDA context, a colocated vLLM engine), so
    on GPUs it raises the trainer's own figure. On CPU, a trainer that reports no peak (ms-swift
    prints no ``memory(GiB)`` there, a template trainer may print nothing) gets the trial process
    tree's peak RSS (``extra["peak_source"] = "host_rss"``); one that reports its own keeps it
    (``"trainer"``). A low-utilization diagnosis is kept for a trial that
    ran (status ok) only: a run that died of OOM or a crash idled because it was dying, and
    "batch 32 may be too small to fill the GPU" on a CUDA OOM at batch 32 (seen on an H100) would
    send the user the wrong way.
    """
    outcome.mean_gpu_util = summary.mean_gpu_util
    data = summary.to_json()
    if summary.peak_memory_gib is not None and device == "cuda":
        outcome.peak_memory_gib = max(outcome.peak_memory_gib or 0.0, summary.peak_memory_gib)
    elif device == "cpu":
        if outcome.peak_memory_gib is None and summary.peak_host_gib is not None:
            outcome.peak_memory_gib = round(summary.peak_host_gib, 3)
            outcome.extra["peak_source"] = "host_rss"
        elif outcome.peak_memory_gib is not None:
            outcome.extra["peak_source"] = "trainer"
    if outcome.status != "ok":
        data["low_util"], data["diagnosis"] = False, None
    elif summary.low_util:
        outcome.extra["low_util"] = True
        outcome.detail = outcome.detail or summary.diagnosis
    outcome.extra["monitor"] = data


def judge(
    result: LaunchResult, monitor: TrialMonitor, recipe: Recipe, warmup: int, *, trial_dir: Path | None = None
) -> Outcome:
    """Turn how the process ended plus what it reported into an Outcome, with the reasons for any
    reported value that was not believed (``extra["rejected_metrics"]``)."""
    outcome = _verdict(result, monitor, recipe, warmup, trial_dir)
    notes = getattr(result, "notes", None)  # a log file that was capped or could not be written
    if notes:
        outcome.extra["log_notes"] = list(notes)
    reasons, count = monitor.rejected()
    if count:
        outcome.extra["rejected_metrics"] = reasons
        outcome.extra["rejected_metrics_count"] = count
    return outcome


def _verdict(
    result: LaunchResult, monitor: TrialMonitor, recipe: Recipe, warmup: int, trial_dir: Path | None
) -> Outcome:
    """The status. A run that measured its steps and ended well (exit 0, or stopped by us once
    measured) is ok whatever its log mentions: trainers and libraries print recovered OOMs, and
    "MemoryError" or "CUDA error: out of memory" in a warning is not a failure. A mention is
    noted in ``extra["memory_mention"]``. Anything else is judged from the whole log files."""
    records = monitor.records
    throughput = steady_throughput(records, warmup, monitor.samples_per_step)
    common = dict(
        peak_memory_gib=monitor.peak_memory_gib(),
        steps=monitor.steps,
        step_times=[r.step_time for r in records if r.step_time is not None],
        wall_time_s=round(result.wall_time_s, 3),
        returncode=result.returncode,
    )
    if throughput and (
        result.stopped in ("measured", "pruned") or (result.stopped is None and result.returncode == 0)
    ):
        extra: dict[str, Any] = {}
        mention = diagnose(result.returncode, result.log_tail, stopped_by_us=True)
        if mention.status == "oom":
            extra["memory_mention"] = mention.error_line
        detail = None if result.stopped else "the trainer finished before all measured steps"
        return Outcome(
            status="ok",
            throughput=throughput,
            pruned=result.stopped == "pruned",
            extra=extra,
            detail=detail,
            **common,
        )
    # a trial we killed ourselves (-9 after SIGTERM was ignored) is not the kernel's OOM killer
    stopped_by_us = result.stopped is not None
    if trial_dir is not None:
        found = diagnose_files(
            result.returncode,
            TrialFiles(trial_dir).logs,
            fallback=result.log_tail,
            stopped_by_us=stopped_by_us,
        )
    else:
        found = diagnose(result.returncode, result.log_tail, stopped_by_us=stopped_by_us)
    status, oom_kind, error_line = found.status, found.oom_kind, found.error_line
    if status == "crash" and (result.stopped in ("measured", "pruned") or result.returncode == 0):
        error_line = monitor.rejected_line() or error_line  # it did not fail; its numbers did
    if status == "oom":
        return Outcome(status="oom", oom_kind=oom_kind, error_line=error_line, **common)
    if result.stopped in ("timeout", "hang"):
        limit = recipe.trial_timeout_s if result.stopped == "timeout" else recipe.hang_timeout_s
        detail = (
            f"no result within --trial-timeout {limit:g}s"
            if result.stopped == "timeout"
            else f"no output for --hang-timeout {limit:g}s"
        )
        return Outcome(status=result.stopped, detail=detail, error_line=error_line, **common)
    timed = [r for r in records if r.step_time is not None]
    if len(timed) > warmup and not any(r.samples for r in timed) and not monitor.samples_per_step:
        return Outcome(
            status="crash",
            error_line=(
                "the trainer logged step times but not how many completions a step trained: write "
                '"samples" in its AUTOTUNE_METRICS_FILE lines, or declare global_batch: in the space'
            ),
            **common,
        )
    if result.returncode == 0:
        return Outcome(
            status="crash",
            error_line=error_line
            or (
                f"the trainer exited after {monitor.steps} step(s) without enough step times; "
                f"it must run at least {warmup + 1} steps and log step_time or write "
                "AUTOTUNE_METRICS_FILE lines"
            ),
            **common,
        )
    return Outcome(status=status, oom_kind=oom_kind, error_line=error_line, **common)
