"""GPU/host monitoring of a running trial (autotune.trial: telemetry, utilization, cleanup).

There is no GPU on CI, so NVML is replaced by ``ReplayNvml``: an object with pynvml's call names
that returns pynvml's own ctypes structures (``c_nvmlUtilization_t``, ``c_nvmlMemory_t``, process
info objects) filled from sample sequences shaped like real trials, and raises pynvml's own error
classes. Everything psutil is real: real child processes, real RSS, real signals. One test runs
the real pynvml module: on this machine nvmlInit raises, and the fallback must be taken.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pynvml
import pytest
from conftest import H100_TOTAL_GIB, ReplayNvml

from autotune.trial.cleanup import read_baseline, wait_for_baseline
from autotune.trial.diagnosis import diagnose_low_util
from autotune.trial.execute import add_monitor_summary
from autotune.trial.outcome import Outcome
from autotune.trial.processes import owned_by_trial
from autotune.trial.telemetry import CSV_COLUMNS, GpuSampler
from autotune.trial.utilization import phase_times, read_ticks, summarize

# A busy 2-GPU trial (ZeRO-2, colocated vLLM): model load, warm-up, measured steps, teardown.
# (phase, [(util %, used GiB) on GPU 0, on GPU 1])
BUSY = [
    ("start", [(0, 0.52), (0, 0.52)]),
    ("start", [(0, 1.10), (0, 1.08)]),
    ("start", [(3, 15.40), (2, 15.38)]),
    ("start", [(12, 46.20), (9, 46.10)]),
    ("warmup", [(71, 58.20), (68, 57.90)]),
    ("warmup", [(95, 71.30), (93, 70.80)]),
    ("warmup", [(88, 71.30), (90, 70.90)]),
    ("measure", [(92, 71.30), (90, 70.90)]),
    ("measure", [(94, 72.40), (93, 71.90)]),
    ("measure", [(89, 71.30), (88, 70.90)]),
    ("measure", [(91, 71.30), (92, 70.90)]),
    ("measure", [(95, 71.80), (94, 71.20)]),
    ("measure", [(90, 71.30), (91, 70.90)]),
    ("end", [(40, 71.30), (0, 70.90)]),
    ("end", [(0, 1.10), (0, 1.08)]),
]

# Recorded gpu.csv of a 1-GPU trial with offload=optimizer (ZeRO-2): the GPU waits on PCIe and CPU
# Adam, DeepSpeed's CPU optimizer keeps ~7 cores busy, host RSS grows with the fp32 optimizer state.
OFFLOAD_CSV = textwrap.dedent("""\
    time_s,phase,gpu,util_pct,mem_used_gib,mem_total_gib,host_rss_gib,host_cpu_pct
    0.000,start,0,0,0.512,79.647,1.204,98.0
    0.251,start,0,4,12.880,79.647,18.640,101.5
    0.502,warmup,0,55,30.120,79.647,38.210,412.0
    0.753,warmup,0,18,30.120,79.647,40.930,688.4
    1.004,measure,0,31,30.410,79.647,41.020,702.3
    1.255,measure,0,12,30.410,79.647,41.020,715.0
    1.506,measure,0,8,30.410,79.647,41.100,698.7
    1.757,measure,0,45,31.950,79.647,41.100,655.2
    2.008,measure,0,38,30.410,79.647,41.100,640.9
    2.259,measure,0,9,30.410,79.647,41.180,721.6
    2.510,measure,0,22,30.410,79.647,41.180,709.9
    2.761,measure,0,35,30.410,79.647,41.180,684.1
    3.012,end,0,0,30.410,79.647,41.180,120.0
    3.263,end,0,0,0.512,79.647,0.000,
""")

# Recorded gpu.csv of a 1-GPU trial with colocated vLLM at vllm_gpu_memory_utilization=0.3: long
# completions, few sequences fit the KV cache, decode runs at low occupancy.
GENERATION_CSV = textwrap.dedent("""\
    time_s,phase,gpu,util_pct,mem_used_gib,mem_total_gib,host_rss_gib,host_cpu_pct
    0.000,start,0,0,0.512,79.647,2.310,99.1
    0.250,start,0,97,24.100,79.647,6.800,100.2
    0.500,warmup,0,41,52.870,79.647,7.020,100.0
    0.750,measure,0,36,52.870,79.647,7.020,100.4
    1.000,measure,0,39,52.870,79.647,7.020,99.8
    1.250,measure,0,34,52.870,79.647,7.020,100.1
    1.500,measure,0,42,52.870,79.647,7.020,100.0
    1.750,measure,0,96,61.300,79.647,7.040,100.3
    2.000,measure,0,33,52.870,79.647,7.040,100.0
    2.250,measure,0,37,52.870,79.647,7.040,99.9
    2.500,measure,0,35,52.870,79.647,7.040,100.2
""")


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def replay(table: list[tuple[str, list[tuple[float, float]]]]) -> ReplayNvml:
    gpus = len(table[0][1])
    return ReplayNvml({g: [row[1][g] for row in table] for g in range(gpus)})


def drive(sampler: GpuSampler, table: list[tuple[str, list]]) -> None:
    """Play a table through the sampler tick by tick, marking phases as the controller would."""
    sampler.open()
    for phase, _ in table:
        if phase != sampler.phase:
            sampler.mark(phase)
        sampler.tick()


# --------------------------------------------------------------------------------------------
# Live sampling with replayed NVML
# --------------------------------------------------------------------------------------------


def test_busy_trial_writes_gpu_csv_and_summarises_measured_steps_only(tmp_path: Path) -> None:
    nvml = replay(BUSY)
    sampler = GpuSampler(
        tmp_path, [0, 1], root_pid=os.getpid(), nvml=nvml, params={"zero_stage": 2, "offload": "none"}
    )
    drive(sampler, BUSY)
    summary = sampler.stop()

    with open(tmp_path / "gpu.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert (
        tuple(rows[0])
        == CSV_COLUMNS
        == (
            "time_s",
            "phase",
            "gpu",
            "util_pct",
            "mem_used_gib",
            "mem_total_gib",
            "host_rss_gib",
            "host_cpu_pct",
        )
    )
    body = rows[1:]
    assert len(body) == 2 * len(BUSY)  # one row per GPU per tick
    assert [r[2] for r in body[:4]] == ["0", "1", "0", "1"]
    assert [r[1] for r in body[::2]] == [phase for phase, _ in BUSY]
    assert body[16][3] == "94" and float(body[16][4]) == pytest.approx(72.40, abs=1e-3)  # 2nd measure tick
    assert all(float(r[5]) == pytest.approx(H100_TOTAL_GIB, abs=1e-3) for r in body)
    assert all(float(r[6]) > 0.01 and r[7] != "" for r in body)  # our own process tree is the "trial"
    times = [float(r[0]) for r in body[::2]]
    assert times == sorted(times)

    measured = [u for phase, gpus in BUSY if phase == "measure" for u, _ in gpus]
    assert summary.mean_gpu_util == pytest.approx(sum(measured) / len(measured) / 100)  # 0.916, not 0.6
    assert summary.mean_gpu_util_per_gpu == pytest.approx([0.9183, 0.9133], abs=1e-3)
    assert summary.peak_memory_gib_per_gpu == pytest.approx([72.40, 71.90], abs=1e-3)
    assert summary.peak_memory_gib == pytest.approx(72.40, abs=1e-3)
    assert summary.gpus == [0, 1] and summary.samples == len(BUSY) and summary.nvml
    assert not summary.low_util and summary.diagnosis is None
    assert summary.peak_host_rss_gib and summary.peak_host_rss_gib > 0.01
    assert nvml.inits == nvml.shutdowns == 1

    again = summarize(read_ticks(tmp_path / "gpu.csv"))  # the file says what the summary says
    assert again.mean_gpu_util == pytest.approx(summary.mean_gpu_util)
    assert again.peak_memory_gib_per_gpu == pytest.approx(summary.peak_memory_gib_per_gpu, abs=1e-3)
    assert again.samples == summary.samples
    data = json.loads(json.dumps(summary.to_json()))
    assert data["mean_gpu_util"] == pytest.approx(0.9158, abs=1e-4) and data["low_util"] is False


def test_mean_is_over_all_samples_when_nothing_was_marked(tmp_path: Path) -> None:
    table = [("start", gpus) for _, gpus in BUSY]
    sampler = GpuSampler(tmp_path, None, nvml=replay(table))  # None: every GPU NVML sees
    drive(sampler, table)
    summary = sampler.stop()
    every = [u for _, gpus in BUSY for u, _ in gpus]
    assert summary.mean_gpu_util == pytest.approx(sum(every) / len(every) / 100)
    assert summary.peak_host_rss_gib is None  # no trial pid: host columns empty
    assert (tmp_path / "gpu.csv").read_text().splitlines()[1].endswith(",,")


def test_failing_nvml_queries_leave_cells_empty(tmp_path: Path) -> None:
    """A MIG slice answers NotSupported for utilization; a missing index is skipped, not fatal."""
    nvml = ReplayNvml(
        {0: [(50, 10.0)] * 3, 1: [(70, 20.0)] * 3}, fail={(0, "util"): pynvml.NVML_ERROR_NOT_SUPPORTED}
    )
    sampler = GpuSampler(tmp_path, [0, 1, 7], nvml=nvml)
    sampler.open()
    for _ in range(3):
        sampler.tick()
    summary = sampler.stop()
    rows = _csv_rows(tmp_path / "gpu.csv")
    assert {r["gpu"] for r in rows} == {"0", "1"}
    assert all(r["util_pct"] == "" for r in rows if r["gpu"] == "0")
    assert summary.mean_gpu_util == pytest.approx(0.70)
    assert summary.mean_gpu_util_per_gpu == [None, pytest.approx(0.70)]
    assert summary.peak_memory_gib_per_gpu == pytest.approx([10.0, 20.0])


def test_thread_samples_and_stops_cleanly(tmp_path: Path) -> None:
    nvml = ReplayNvml({0: [(90, 40.0)] * 1000})
    sampler = GpuSampler(tmp_path, [0], root_pid=os.getpid(), interval_s=0.02, nvml=nvml).start()
    time.sleep(0.1)
    sampler.mark("measure")
    time.sleep(0.15)
    started = time.monotonic()
    summary = sampler.stop()
    assert time.monotonic() - started < 1.0
    assert not any(t.name.startswith("gpumon-") for t in threading.enumerate())
    assert summary.samples >= 5 and summary.mean_gpu_util == pytest.approx(0.90)
    assert {t.phase for t in sampler.ticks} == {"start", "measure"}
    assert sampler.stop() is summary  # idempotent
    calls = nvml.memory_calls
    time.sleep(0.1)
    assert nvml.memory_calls == calls  # nothing samples after stop
    assert nvml.inits == nvml.shutdowns == 1
    lines = (tmp_path / "gpu.csv").read_text().splitlines()
    assert len(lines) == summary.samples + 1


def test_root_pid_comes_from_the_launchers_pid_file(tmp_path: Path) -> None:
    sampler = GpuSampler(tmp_path, [0], nvml=ReplayNvml({0: [(10, 1.0)]}))
    sampler.open()
    assert sampler.tick().host_rss_gib is None
    (tmp_path / "pid").write_text(f"{os.getpid()}\n")
    assert sampler.tick().host_rss_gib > 0.01
    sampler.stop()


# --------------------------------------------------------------------------------------------
# Recorded gpu.csv files and the low-utilization rule
# --------------------------------------------------------------------------------------------


def test_offload_bound_trial_is_flagged_with_the_offload_reason(tmp_path: Path) -> None:
    path = tmp_path / "gpu.csv"
    path.write_text(OFFLOAD_CSV)
    ticks = read_ticks(path)
    assert len(ticks) == 14 and ticks[-1].host_cpu_pct is None
    summary = summarize(
        ticks,
        params={"zero_stage": 2, "offload": "optimizer", "per_device_train_batch_size": 4},
        min_util=0.5,
    )
    assert summary.mean_gpu_util == pytest.approx(0.25)
    assert summary.peak_memory_gib_per_gpu == pytest.approx([31.95])
    assert summary.peak_host_rss_gib == pytest.approx(41.18)
    assert summary.mean_host_cpu_pct == pytest.approx(690.96, abs=0.01)
    assert summary.low_util
    assert summary.idle_share == pytest.approx(1.0)
    assert summary.diagnosis.startswith(
        "GPU utilization 25% < 50% (below it 100% of the time): offload=optimizer"
    )
    assert "PCIe" in summary.diagnosis and "zero_stage 3 without offload" in summary.diagnosis
    assert "host CPU 691% of a core" in summary.diagnosis
    assert "\n" not in summary.diagnosis


def test_generation_bound_trial_with_small_vllm_cache(tmp_path: Path) -> None:
    (tmp_path / "gpu.csv").write_text(GENERATION_CSV)
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "step_time": 61.0, "generation_time": 50.0, "training_time": 11.0},  # warm-up
        {"step": 2, "step_time": 40.0, "generation_time": 31.0, "training_time": 9.0},
        {"step": 3, "step_time": 30.0, "generation_time": 24.0, "training_time": 6.0, "samples": 64},
        {"step": 4, "step_time": 31.0, "generation_time": 24.5, "training_time": 6.5, "samples": 64},
        {"step": 5, "step_time": 29.0, "generation_time": 23.5, "training_time": 5.5, "samples": 64},
    ]
    metrics.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 6, "step_ti')  # torn last line
    times = phase_times(metrics, after_step=2)
    assert times == {"generation_time": 72.0, "training_time": 18.0, "step_time": 90.0, "steps": 3.0}

    params = {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.3,
        "zero_stage": 0,
        "offload": "none",
    }
    summary = summarize(read_ticks(tmp_path / "gpu.csv"), params=params, step_times=times)
    assert summary.mean_gpu_util == pytest.approx(0.44)  # the 96% spike is one training step
    assert summary.peak_memory_gib_per_gpu == pytest.approx([61.30])
    assert summary.low_util
    assert "generation takes 80% of each step" in summary.diagnosis
    assert "vLLM cache is small (vllm_gpu_memory_utilization=0.3)" in summary.diagnosis
    assert summary.diagnosis.endswith("raise vllm_gpu_memory_utilization so more sequences decode at once")

    # the same samples without the step times: nothing in the parameters explains it, and the one
    # busy core (the trainer spin-waiting on CUDA) is not taken for a CPU-bound step
    blind = summarize(read_ticks(tmp_path / "gpu.csv"), params=params)
    assert blind.low_util and "no cause stands out" in blind.diagnosis
    # a threshold the mean passes still diagnoses a GPU that spent 6 of 8 samples below it
    near = summarize(read_ticks(tmp_path / "gpu.csv"), params=params, min_util=0.4)
    assert near.low_util and near.idle_share == pytest.approx(0.75)
    assert near.diagnosis.startswith("GPU utilization below 40% for 75% of the time (mean 44%)")
    # a threshold under every measured sample: not low
    assert not summarize(read_ticks(tmp_path / "gpu.csv"), params=params, min_util=0.3).low_util


def test_a_failed_trial_gets_no_low_utilization_advice(tmp_path: Path) -> None:
    """On an H100 a CUDA OOM at batch 32 was told "batch 32 may be too small to fill the GPU": a
    dying run idles because it dies, so only a trial that ran is diagnosed."""
    (tmp_path / "gpu.csv").write_text(GENERATION_CSV)
    params = {"per_device_train_batch_size": 32, "zero_stage": 0, "offload": "none", "use_vllm": False}
    summary = summarize(read_ticks(tmp_path / "gpu.csv"), params=params)
    assert summary.low_util
    oom = Outcome(status="oom", oom_kind="cuda", error_line="torch.OutOfMemoryError: CUDA out of memory.")
    add_monitor_summary(oom, summary, "cuda")
    assert "low_util" not in oom.extra and oom.detail is None
    assert oom.extra["monitor"]["low_util"] is False and oom.extra["monitor"]["diagnosis"] is None
    assert oom.peak_memory_gib == pytest.approx(61.30) and oom.mean_gpu_util == pytest.approx(
        summary.mean_gpu_util
    )
    ok = Outcome(status="ok", throughput=3.0, peak_memory_gib=70.0)
    add_monitor_summary(ok, summary, "cuda")
    assert ok.extra["low_util"] is True and ok.detail == summary.diagnosis
    assert ok.extra["monitor"]["diagnosis"] == summary.diagnosis and ok.peak_memory_gib == 70.0


def test_phase_times_absent_for_trainers_without_them(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 3, "step_time": 41.2, "samples": 256}\n')
    assert phase_times(metrics, after_step=0) is None
    assert phase_times(tmp_path / "missing.jsonl") is None


@pytest.mark.parametrize(
    "util, params, step_times, cpu, gpus, expect",
    [
        (0.9, {"offload": "optimizer"}, None, None, 1, None),
        (None, {"offload": "optimizer"}, None, None, 1, None),
        (
            0.3,
            {"offload": "optimizer+params", "zero_stage": 3},
            None,
            None,
            1,
            "offload=optimizer+params moves the weights over PCIe",
        ),
        # measured evidence first: generation dominates even though offload is on
        (
            0.3,
            {"offload": "optimizer", "use_vllm": False},
            {"generation_time": 9.0, "training_time": 1.0},
            None,
            1,
            "generation takes 90% of each step with transformers' generate: enable use_vllm",
        ),
        (
            0.3,
            {"use_vllm": True, "vllm_gpu_memory_utilization": 0.8},
            {"generation_time": 7, "training_time": 3},
            None,
            1,
            "larger per_device_train_batch_size",
        ),
        (
            0.3,
            {"vllm_gpu_memory_utilization": "0.25"},
            {"generation_time": 7, "training_time": 3},
            None,
            1,
            "the vLLM cache is small (vllm_gpu_memory_utilization=0.25)",
        ),
        (
            0.2,
            {"offload": "none", "zero_stage": 3},
            None,
            1000.0,
            4,
            "the host CPU is busy (250% of a core per GPU)",
        ),
        # one core per rank is CUDA's spin-wait, not evidence of a CPU-bound step
        (
            0.2,
            {"offload": "none", "zero_stage": 3},
            None,
            400.0,
            4,
            "ZeRO-3 gathers the weights across 4 GPUs",
        ),
        (
            0.2,
            {"offload": "none", "zero_stage": 3},
            None,
            150.0,
            8,
            "ZeRO-3 gathers the weights across 8 GPUs",
        ),
        (0.2, {"offload": "none", "zero_stage": 3}, None, None, 1, "no cause stands out"),
        (
            0.2,
            {"per_device_train_batch_size": 1},
            {"generation_time": 1, "training_time": 9},
            30.0,
            1,
            "per_device_train_batch_size=1 may be too small",
        ),
    ],
)
def test_low_util_rule(util, params, step_times, cpu, gpus, expect) -> None:
    text = diagnose_low_util(util, params, 0.5, step_times, host_cpu_pct=cpu, gpus=gpus)
    if expect is None:
        assert text is None
    else:
        assert text is not None and expect in text, text
        assert text.startswith(f"GPU utilization {util:.0%} < 50%: ") and "\n" not in text


# --------------------------------------------------------------------------------------------
# No NVML: the real pynvml on a machine without a driver, and psutil on a real process tree
# --------------------------------------------------------------------------------------------


def _real_nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_real_pynvml_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real module end to end: on a GPU machine it samples; without one it falls back quietly."""
    caplog.set_level("INFO", logger="autotune.nvml")
    sampler = GpuSampler(
        tmp_path, [0], root_pid=os.getpid(), interval_s=0.02
    ).start()  # nvml=None: real pynvml
    time.sleep(0.1)
    summary = sampler.stop()
    rows = _csv_rows(tmp_path / "gpu.csv")
    assert rows and all(float(r["host_rss_gib"]) > 0.01 for r in rows)
    if _real_nvml_works():  # a developer's GPU box
        assert summary.nvml and summary.gpus == [0] and summary.mean_gpu_util is not None
        assert all(r["gpu"] == "0" and float(r["mem_total_gib"]) > 1 for r in rows)
        assert isinstance(read_baseline([0]), dict)
        return
    with pytest.raises(pynvml.NVMLError):  # what the fallback is protecting against, here and on CI
        pynvml.nvmlInit()
    assert "NVML could not be initialised (NVMLError_" in caplog.text
    assert all(r["gpu"] == r["util_pct"] == r["mem_used_gib"] == r["mem_total_gib"] == "" for r in rows)
    assert not summary.nvml and summary.gpus == [] and summary.peak_memory_gib_per_gpu == []
    assert summary.mean_gpu_util is None and not summary.low_util and summary.diagnosis is None
    assert read_baseline([0]) is None
    started = time.monotonic()
    assert wait_for_baseline([0], {0: 500.0}, timeout_s=30, pgid=None) is True
    assert time.monotonic() - started < 1.0


def test_injected_nvml_whose_init_fails_falls_back(tmp_path: Path) -> None:
    nvml = ReplayNvml({0: [(90, 40.0)]}, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    sampler = GpuSampler(tmp_path, [0], root_pid=os.getpid(), nvml=nvml)
    sampler.open()
    tick = sampler.tick()
    assert tick.gpus == [] and tick.host_rss_gib > 0.01
    assert sampler.stop().mean_gpu_util is None
    assert nvml.memory_calls == 0


ALLOCATING_TREE = textwrap.dedent("""\
    import subprocess, sys
    leaf = ("import pathlib, sys, time\\n"
            "block = b'\\\\x01' * (200 * 1024 * 1024)\\n"
            "pathlib.Path(sys.argv[1]).write_text('ready')\\n"
            "time.sleep(60)\\n")
    subprocess.run([sys.executable, "-c", leaf, sys.argv[1]])
""")


def test_fallback_measures_the_real_process_tree(tmp_path: Path) -> None:
    """Host RSS is summed over the tree: the 200 MB live in a grandchild of the root pid."""
    ready = tmp_path / "ready"
    root = subprocess.Popen([sys.executable, "-c", ALLOCATING_TREE, str(ready)], start_new_session=True)
    try:
        sampler = GpuSampler(tmp_path, [0], interval_s=0.05, nvml=ReplayNvml({0: []}, init_error=1)).start()
        sampler.set_root_pid(root.pid)
        deadline = time.monotonic() + 8
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), "the allocating child did not start"
        time.sleep(0.2)
        summary = sampler.stop()
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
    assert summary.peak_host_rss_gib is not None and summary.peak_host_rss_gib >= 0.15
    assert summary.mean_gpu_util is None and not summary.nvml
    rows = _csv_rows(tmp_path / "gpu.csv")
    assert max(float(r["host_rss_gib"]) for r in rows) >= 0.15
    assert all(r["host_cpu_pct"] != "" for r in rows)


# --------------------------------------------------------------------------------------------
# Back to baseline between trials
# --------------------------------------------------------------------------------------------


class DrainingNvml(ReplayNvml):
    """Memory stays up for ``polls`` reads, or while ``holder()`` says a process still holds it."""

    def __init__(
        self,
        baseline_gib: float,
        extra_gib: float,
        *,
        polls: int | None = None,
        holder=None,
        processes: dict[int, list[int]] | None = None,
    ) -> None:
        super().__init__({0: [(0, baseline_gib)]}, processes=processes)
        self.baseline_gib, self.extra_gib, self.polls, self.holder = baseline_gib, extra_gib, polls, holder

    def used_gib(self, index: int) -> float:
        busy = self.holder() if self.holder else self.memory_calls <= self.polls
        return self.baseline_gib + (self.extra_gib if busy else 0.0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        """Like the driver: a process that has exited is no longer listed."""
        listed = super().nvmlDeviceGetComputeRunningProcesses(handle)
        return [info for info in listed if _alive(info.pid)]


def _alive(proc: subprocess.Popen | int) -> bool:
    pid = proc if isinstance(proc, int) else proc.pid
    if not isinstance(proc, int) and proc.poll() is not None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _sleeper(env: dict[str, str] | None = None, new_session: bool = True) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )


def test_read_baseline_in_mib() -> None:
    nvml = ReplayNvml({0: [(0, 0.5)], 1: [(0, 1.25)]})
    assert read_baseline(None, nvml=nvml) == {0: pytest.approx(512.0), 1: pytest.approx(1280.0)}
    assert nvml.inits == nvml.shutdowns == 1


def test_wait_for_baseline_waits_while_memory_drains() -> None:
    nvml = DrainingNvml(0.5, 30.0, polls=3)
    started = time.monotonic()
    assert wait_for_baseline([0], {"0": 512.0}, timeout_s=5, poll_s=0.01, nvml=nvml) is True  # JSON keys
    assert time.monotonic() - started < 1.0
    assert nvml.memory_calls == 4 and nvml.inits == nvml.shutdowns == 1


def test_wait_for_baseline_within_tolerance_is_reached_at_once() -> None:
    nvml = DrainingNvml(0.5, 0.8, polls=10**6)  # 0.8 GiB above: inside the 1 GiB tolerance
    assert wait_for_baseline([0], {0: 512.0}, timeout_s=5, poll_s=0.01, nvml=nvml) is True
    assert nvml.memory_calls == 1


def test_wait_for_baseline_kills_trial_leftovers_but_not_foreign_processes(tmp_path: Path) -> None:
    trial_dir = tmp_path / "trials" / "3"
    owned = _sleeper({"AUTOTUNE_TRIAL_DIR": str(trial_dir)})
    other_trial = _sleeper({"AUTOTUNE_TRIAL_DIR": str(tmp_path / "trials" / "9")})
    foreign = _sleeper()
    try:
        time.sleep(0.2)  # let exec finish, so /proc/<pid>/environ is the child's
        nvml = DrainingNvml(
            0.5,
            20.0,
            holder=lambda: _alive(owned),
            processes={0: [foreign.pid, other_trial.pid, owned.pid, os.getpid()]},
        )
        assert (
            wait_for_baseline(
                [0],
                {0: 512.0},
                timeout_s=0.2,
                poll_s=0.02,
                nvml=nvml,
                trial_dir=trial_dir,
                grace_s=3,
                settle_s=2,
            )
            is True
        )
        owned.wait(timeout=5)
        assert not _alive(owned)
        assert _alive(foreign) and _alive(other_trial)
    finally:
        for proc in (owned, other_trial, foreign):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_trial_ownership_is_by_environment_and_folder(tmp_path: Path) -> None:
    trials = tmp_path / "trials"
    owned = _sleeper({"AUTOTUNE_TRIAL_DIR": str(trials / "3")})
    foreign = _sleeper()
    try:
        time.sleep(0.2)
        assert owned_by_trial(owned.pid, None) is not None
        assert owned_by_trial(owned.pid, trials) is not None  # any trial of this study
        assert owned_by_trial(owned.pid, trials / "3") is not None
        assert owned_by_trial(owned.pid, trials / "30") is None  # a prefix is not a folder
        assert owned_by_trial(foreign.pid, None) is None
        assert owned_by_trial(1, None) is None  # init: AccessDenied or no env
    finally:
        for proc in (owned, foreign):
            proc.kill()
            proc.wait()


def test_wait_for_baseline_kills_the_trials_process_group() -> None:
    """The leader is gone but a grandchild (a vLLM worker, say) still holds the GPU."""
    code = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(p.pid, flush=True)"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    straggler = int(leader.stdout.readline())
    leader.wait(timeout=5)
    leader.stdout.close()
    try:
        assert _alive(straggler)
        nvml = DrainingNvml(0.5, 20.0, holder=lambda: _alive(straggler))  # NVML does not list it
        assert (
            wait_for_baseline(
                [0], {0: 512.0}, timeout_s=0.2, poll_s=0.02, pgid=leader.pid, nvml=nvml, grace_s=3, settle_s=2
            )
            is True
        )
        assert not _alive(straggler)
    finally:
        if _alive(straggler):
            os.kill(straggler, signal.SIGKILL)


def test_wait_for_baseline_gives_up_without_touching_our_own_group() -> None:
    nvml = DrainingNvml(0.5, 20.0, polls=10**6, processes={0: [os.getpid()]})
    started = time.monotonic()
    assert (
        wait_for_baseline(
            [0], {0: 512.0}, timeout_s=0.1, poll_s=0.02, pgid=os.getpgrp(), nvml=nvml, settle_s=0.1
        )
        is False
    )
    assert time.monotonic() - started < 2.0  # we are alive to see it


def test_wait_for_baseline_without_a_baseline_waits_for_trial_processes(tmp_path: Path) -> None:
    """No baseline recorded (e.g. a resumed study): clean means no trial process left on the GPUs."""
    owned = _sleeper({"AUTOTUNE_TRIAL_DIR": str(tmp_path)})
    try:
        time.sleep(0.2)
        nvml = DrainingNvml(0.5, 20.0, polls=10**6, processes={0: [owned.pid]})
        assert (
            wait_for_baseline([0], None, timeout_s=0.1, poll_s=0.02, nvml=nvml, grace_s=3, settle_s=2) is True
        )
        owned.wait(timeout=5)
        assert not _alive(owned)
    finally:
        if owned.poll() is None:
            owned.kill()
            owned.wait()
