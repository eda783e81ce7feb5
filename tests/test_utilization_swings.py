"""The low-utilization diagnosis judges time spent below --min-util, not only the mean.

Write-up 004 (ms-swift GRPO, Qwen2.5-VL-3B, 2 GPUs, ``--deepspeed zero3_offload``, ``offload_model``,
``offload_optimizer``, ``move_model_batches 16``, ``sleep_level 1``): utilization swung between 0% and
90%, averaging ~50%, and the fix (zero3, offloads off) was found by hand. The timelines below have
that shape: vLLM generation waves at 85-92%, the weights moved back and the engine woken at 0-10%,
offloaded ZeRO-3 training at 55-90%, CPU Adam at 0-7% while the host's cores are busy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BUSY_CSV, SWIFT_004, SWING_CSV

from autotune.trial.diagnosis import IDLE_SHARE_LIMIT, diagnose_low_util
from autotune.trial.utilization import read_ticks, summarize, summarize_file


def swing(tmp_path: Path) -> Path:
    path = tmp_path / "gpu.csv"
    path.write_text(SWING_CSV)
    return path


def test_a_swing_averaging_above_min_util_is_diagnosed_in_swifts_words(tmp_path: Path) -> None:
    summary = summarize_file(swing(tmp_path), params=SWIFT_004, min_util=0.5)
    assert summary is not None and summary.samples == 36 and summary.gpus == [0, 1]
    assert summary.mean_gpu_util == pytest.approx(0.5268, abs=1e-3)  # the measured steps only
    assert summary.idle_share == pytest.approx(24 / 68)
    # the mean alone passes it: what autotune said before (nothing)
    assert diagnose_low_util(summary.mean_gpu_util, SWIFT_004, 0.5) is None
    assert summary.low_util
    text = summary.diagnosis
    assert text.startswith("GPU utilization below 50% for 35% of the time (mean 53%): "), text
    for knob in (
        "--offload_model false",
        "--offload_optimizer false",
        "--sleep_level 0",
        "no --move_model_batches",
        "--deepspeed zero3 instead of zero3_offload",
    ):
        assert knob in text, knob
    assert "offload_model and offload_optimizer move the weights and optimizer state to the CPU" in text
    assert "zero_stage 3 without offload" not in text and "\n" not in text


def test_the_same_swing_under_trl_names_gets_trls_advice(tmp_path: Path) -> None:
    trl = {"zero_stage": 3, "offload": "optimizer+params", "use_vllm": True, "vllm_enable_sleep_mode": True}
    text = summarize_file(swing(tmp_path), params=trl).diagnosis
    assert "offload=optimizer+params moves the weights over PCIe" in text and "--offload_model" not in text
    sleep_only = {"zero_stage": 2, "offload": "none", "use_vllm": True, "vllm_enable_sleep_mode": True}
    assert "vllm_enable_sleep_mode=false" in summarize_file(swing(tmp_path), params=sleep_only).diagnosis


def test_swift_knobs_that_are_off_are_not_blamed(tmp_path: Path) -> None:
    quiet = {
        "zero_stage": 3,
        "offload": "none",
        "offload_model": False,
        "offload_optimizer": False,
        "sleep_level": 0,
        "move_model_batches": None,
    }
    text = summarize_file(swing(tmp_path), params=quiet).diagnosis
    # with every offload off, the samples' own evidence speaks: the host's cores were busy
    assert "the host CPU is busy (224% of a core per GPU)" in text
    assert "sleep_level" not in text and "offload_model" not in text
    no_cpu = read_ticks(swing(tmp_path))  # the same samples where psutil saw nothing
    for t in no_cpu:
        t.host_cpu_pct = None
    assert "ZeRO-3 gathers the weights across 2 GPUs" in summarize(no_cpu, params=quiet).diagnosis


def test_a_busy_run_with_short_sync_dips_is_not_diagnosed(tmp_path: Path) -> None:
    path = tmp_path / "gpu.csv"
    path.write_text(BUSY_CSV)
    summary = summarize_file(path, params={"zero_stage": 2, "offload": "none"})
    assert summary.idle_share == pytest.approx(4 / 24) and summary.idle_share < IDLE_SHARE_LIMIT
    assert not summary.low_util and summary.diagnosis is None
    # a stricter --min-util sees the same run differently: the threshold is the user's
    assert summarize_file(path, min_util=0.95).low_util


@pytest.mark.parametrize("share, flagged", [(IDLE_SHARE_LIMIT, True), (IDLE_SHARE_LIMIT - 0.01, False)])
def test_the_idle_share_limit(share: float, flagged: bool) -> None:
    text = diagnose_low_util(0.7, {}, 0.5, idle_share=share)
    assert (text is not None) == flagged
    if flagged:
        assert text.startswith(f"GPU utilization below 50% for {share:.0%} of the time (mean 70%)")


def test_a_torn_or_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "gpu.csv"
    path.write_text(SWING_CSV + "26.500,meas")  # the trial died mid-line
    assert len(read_ticks(path)) == 36
    assert summarize(read_ticks(path)).samples == 36
    assert summarize_file(tmp_path / "missing.csv") is None
    (tmp_path / "empty.csv").write_text(SWING_CSV.splitlines()[0] + "\n")  # the header only
    assert summarize_file(tmp_path / "empty.csv") is None


def test_ticks_within_one_millisecond_read_back_as_ticks(tmp_path: Path) -> None:
    """time_s has three decimals: a sampler ticked faster (a loaded CI machine's replay, a clock
    step) writes ticks that share it, and each GPU's second row is the next tick, not a third GPU."""
    header, *rows = SWING_CSV.splitlines()
    path = tmp_path / "gpu.csv"
    path.write_text("\n".join([header, *("1.000," + row.split(",", 1)[1] for row in rows)]) + "\n")
    ticks = read_ticks(path)
    assert len(ticks) == 36 and all([r.gpu for r in t.gpus] == [0, 1] for t in ticks)
    assert summarize(ticks).samples == summarize(read_ticks(swing(tmp_path))).samples == 36
