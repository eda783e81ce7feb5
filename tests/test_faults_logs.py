"""Issue 9, faults 4, 5 and 8 (third bullet), and rejected measurements: what a trial's logs and
metrics say must be read right, however much noise surrounds it.

Every trial here is a real Python process run through the real launch/execute path (or the real
``autotune search --command`` CLI), writing real log and metrics files. The error texts are the
libraries' own: the CUDA OOM as captured on an H100, torch.distributed.elastic's ChildFailedError
block as torchrun printed it (tests/data/logs/torchrun_rank0_host_oom_gloo.log), vLLM's
``No available memory for the cache blocks`` and ``Engine core initialization failed``.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (
    CHILD_FAILED,
    CUDA_OOM,
    RANK0_TRACEBACK,
    ReplayNvml,
    noise,
    run_cli,
    run_script_trial,
    trainer,
)

from autotune.trial.cleanup import read_baseline
from autotune.trial.logparse import parse_log_dicts

VLLM_KV = (
    "(EngineCore_DP0 pid=245) ERROR 07-11 06:23:05 [core.py:700] ValueError: No available memory for "
    "the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
)
VLLM_WRAPPER = """\
Traceback (most recent call last):
  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/utils.py", line 1209, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"""


# --- fault 4: the OOM that caused the failure is lost behind teardown noise -------------------


def test_cuda_oom_followed_by_teardown_noise_and_child_failed_is_oom(tmp_path: Path) -> None:
    outcome = run_script_trial(tmp_path, trainer(RANK0_TRACEBACK + noise(2000) + CHILD_FAILED.splitlines()))
    assert (outcome.status, outcome.oom_kind) == ("oom", "cuda"), outcome
    assert outcome.error_line.startswith(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB"
    )


def test_vllm_kv_oom_on_stdout_wrapped_by_engine_core_failure_is_oom(tmp_path: Path) -> None:
    outcome = run_script_trial(
        tmp_path, trainer(noise(1500) + VLLM_WRAPPER.splitlines(), stdout=[VLLM_KV] + noise(1500))
    )
    assert (outcome.status, outcome.oom_kind) == ("oom", "vllm_kv"), outcome
    assert "No available memory for the cache blocks" in outcome.error_line


def test_first_memory_error_wins_in_a_long_log(tmp_path: Path) -> None:
    """A few MiB of log: the OOM near the start decides, not the ChildFailedError at the end, and
    reading the whole files stays quick."""
    started = time.monotonic()
    outcome = run_script_trial(tmp_path, trainer(RANK0_TRACEBACK + noise(30_000) + CHILD_FAILED.splitlines()))
    assert (outcome.status, outcome.oom_kind) == ("oom", "cuda"), outcome
    assert time.monotonic() - started < 60  # about 3 s idle; 5x on a loaded machine, and slack


def test_a_plain_crash_behind_noise_is_still_a_crash_with_its_own_error(tmp_path: Path) -> None:
    crash = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/w/t.py", line 3, in <module>',
        "[rank0]: KeyError: 'format'",
    ]
    outcome = run_script_trial(tmp_path, trainer(crash + noise(2000) + CHILD_FAILED.splitlines()))
    assert outcome.status == "crash" and outcome.error_line == "KeyError: 'format'", outcome


@pytest.mark.slow
def test_search_with_oom_behind_noise_learns_oom_and_does_not_stop_as_a_crash(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(trainer(RANK0_TRACEBACK + noise(2000) + CHILD_FAILED.splitlines()))
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "1",
        "--gpu-type",
        "A10G",
        "--device",
        "cpu",
        "--command",
        f"{sys.executable} t.py {{per_device_train_batch_size}}",
        "--trials",
        "4",
        "--confirm",
        "0",
        "--name",
        "noisy",
        cwd=tmp_path,
        timeout=600,  # 16.7 s idle; a hang guard, not a speed test (it hit 120 s on a loaded machine)
    )
    assert "same crash" not in res.stderr, res.stderr
    got = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "noisy").glob("trials/*/outcome.json")]
    launched = [o for o in got if o.get("launched")]
    assert launched and all((o["status"], o["oom_kind"]) == ("oom", "cuda") for o in launched), launched


# --- fault 5: a good run is misread as OOM ----------------------------------------------------

MEASURED = [{"step": s, "step_time": 0.5, "samples": 64} for s in range(1, 4)]  # warm-up 2, one measured


@pytest.mark.parametrize(
    "mention",
    [
        "RuntimeError: CUDA error: out of memory (caught; retrying with a smaller chunk)",
        "torch.OutOfMemoryError",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. (recovered: batch halved)",
        "MemoryError: none",
    ],
)
def test_a_run_that_exits_0_with_steps_measured_is_ok_whatever_its_log_mentions(
    tmp_path: Path, mention: str
) -> None:
    outcome = run_script_trial(tmp_path, trainer([mention], stdout=[mention], exit_code=0, metrics=MEASURED))
    assert outcome.status == "ok" and outcome.throughput == pytest.approx(128.0), outcome
    assert outcome.extra.get("memory_mention"), outcome.extra


def test_a_run_stopped_by_us_once_measured_is_ok_despite_an_oom_mention(tmp_path: Path) -> None:
    metrics = [{"step": s, "step_time": 0.5, "samples": 64} for s in range(1, 7)]
    outcome = run_script_trial(
        tmp_path, trainer(["[rank0]: " + CUDA_OOM], exit_code=0, metrics=metrics, sleep_s=30)
    )
    assert outcome.status == "ok" and outcome.throughput == pytest.approx(128.0), outcome


def test_a_run_that_exits_nonzero_with_an_oom_after_measuring_is_oom(tmp_path: Path) -> None:
    outcome = run_script_trial(tmp_path, trainer(RANK0_TRACEBACK, exit_code=1, metrics=MEASURED))
    assert (outcome.status, outcome.oom_kind) == ("oom", "cuda"), outcome


# --- fault 30: a multi-process trainer that aborts in its teardown after its measured steps --------

TEARDOWN_ABORT = "terminate called without an active exception"  # libstdc++'s words, rank 1's last line
ALL_MEASURED = [{"step": s, "step_time": 0.5, "samples": 64} for s in range(1, 6)]  # warm-up 2, 3 measured


def test_a_teardown_abort_after_every_measured_step_keeps_the_measurement(tmp_path: Path) -> None:
    outcome = run_script_trial(tmp_path, trainer([TEARDOWN_ABORT], metrics=ALL_MEASURED, abort=True))
    assert outcome.status == "ok" and outcome.throughput == pytest.approx(128.0), outcome


def test_an_abort_before_the_measured_steps_are_in_is_still_a_crash(tmp_path: Path) -> None:
    outcome = run_script_trial(tmp_path, trainer([TEARDOWN_ABORT], metrics=ALL_MEASURED[:3], abort=True))
    assert outcome.status == "crash" and outcome.throughput is None, outcome


# --- fault 8, third bullet: a line of nested braces blocks the loop ---------------------------


@pytest.mark.parametrize("size", [30_000, 1_000_000])
def test_nested_braces_parse_in_linear_time(size: int) -> None:
    for line in (
        "{" * (size // 2) + "}" * (size // 2),
        '{"a": ' * (size // 6) + "1" + "}" * (size // 6),
        "x{" * (size // 2),
        "{'loss': 0.1, 'step_time': 0.2} " + "{" * (size // 2),
    ):
        started = time.monotonic()
        parse_log_dicts(line)
        assert time.monotonic() - started < 3.0, line[:40]  # 0.2 s idle; quadratic took minutes


def test_dicts_are_still_found_around_garbage() -> None:
    line = "{{ {'loss': 0.5, 'step_time': 1.5} {{{ \"x{\" } {'a': {'b': 1}}"
    assert parse_log_dicts(line) == [{"loss": 0.5, "step_time": 1.5}, {"a": {"b": 1}}]


def test_lines_of_nested_braces_do_not_delay_the_trial_timeout(tmp_path: Path) -> None:
    """Launch hands the monitor at most 8 KiB of a line; 8,000 characters of balanced braces took
    the quadratic parser about 2 s each, so ten such lines held a 2 s timeout off for over 9 s."""
    script = textwrap.dedent("""\
        import sys, time
        for _ in range(10):
            print("{" * 4000 + "}" * 4000, flush=True)
        time.sleep(60)
        """)
    started = time.monotonic()
    outcome = run_script_trial(tmp_path, script, timeout_s=2.0)
    assert outcome.status == "timeout", outcome
    assert time.monotonic() - started < 8, outcome.wall_time_s  # 2.2 s idle; the fault took over 9 s


# --- implausible measurements are rejected, with the reason recorded --------------------------


def test_rejected_measurements_say_why_in_outcome_json(tmp_path: Path) -> None:
    metrics = [
        {"step": 1, "step_time": 1e-300, "samples": 64},
        {"step": 2, "step_time": 0.5, "samples": 1e308},
    ]
    metrics += [{"step": s, "step_time": 0.5, "samples": 64} for s in range(1, 7)]
    outcome = run_script_trial(tmp_path, trainer([], exit_code=0, metrics=metrics, sleep_s=30))
    assert outcome.status == "ok" and outcome.throughput == pytest.approx(128.0)
    saved = json.loads((tmp_path / "trials" / "0" / "outcome.json").read_text())
    reasons = saved["extra"]["rejected_metrics"]
    assert any("step 1" in r and "step_time" in r and "1e-300" in r for r in reasons), reasons
    assert any("step 2" in r and "samples" in r for r in reasons), reasons


def test_rejected_log_dict_step_times_say_why(tmp_path: Path) -> None:
    lines = [repr({"loss": 0.1, "step_time": t, "epoch": 0.1}) for t in (1e-300, 0.5, 0.5, 0.5, 0.5)]
    outcome = run_script_trial(tmp_path, trainer([], stdout=lines, exit_code=0))
    reasons = outcome.extra.get("rejected_metrics", [])
    assert any("step 1" in r and "step_time" in r for r in reasons), outcome.extra


# --- leftover GPU memory from the previous trial (issue 8 relies on it) -----------------------


def test_leftover_memory_at_the_start_of_a_trial_is_measured_in_gib() -> None:
    from autotune.trial.execute import leftover_gib

    baseline = read_baseline([0, 1], nvml=ReplayNvml({0: [(0, 0.5)], 1: [(0, 0.5)]}))
    now = ReplayNvml({0: [(0, 0.9)], 1: [(0, 12.5)]})  # GPU 1 still holds 12 GiB of the last trial
    assert leftover_gib([0, 1], baseline, nvml=now) == pytest.approx(12.0, abs=0.01)
    clean = ReplayNvml({0: [(0, 1.2)], 1: [(0, 0.5)]})  # within the 1 GiB tolerance
    assert leftover_gib([0, 1], baseline, nvml=clean) is None
    # the previous cleanup gave up: the amount read now is recorded even within tolerance
    assert leftover_gib(
        [0, 1], baseline, nvml=ReplayNvml({0: [(0, 1.2)], 1: [(0, 0.5)]}), previous_failed=True
    ) == pytest.approx(0.7, abs=0.01)
    assert leftover_gib([0, 1], None, nvml=now) is None  # no baseline, nothing to compare


# --- reading whole log files ------------------------------------------------------------------

FIXTURES = sorted((Path(__file__).parent / "data" / "logs").glob("*.log"))


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.name for p in FIXTURES])
@pytest.mark.parametrize("returncode", [1, -9])
def test_reading_the_file_judges_every_fixture_as_its_whole_text_does(
    tmp_path: Path, fixture: Path, returncode: int
) -> None:
    """The file reader keeps only the lines that can decide (and their context): it must never
    change a verdict the whole text gives."""
    from autotune.trial.classify import diagnose, diagnose_files

    text = fixture.read_text(encoding="utf-8", errors="replace")
    (tmp_path / "stderr.log").write_text(text)
    assert diagnose_files(returncode, [tmp_path / "stderr.log", tmp_path / "stdout.log"]) == diagnose(
        returncode, text
    )


@pytest.mark.slow
def test_a_capped_64_mib_log_is_read_whole_and_quickly(tmp_path: Path) -> None:
    from autotune.trial.classify import diagnose_files

    block = ("\n".join(noise(200)) + "\n").encode()
    with open(tmp_path / "stderr.log", "wb") as out:
        out.write(("\n".join(noise(50)) + "\n").encode())
        while out.tell() < 40 * 2**20:
            out.write(block)
        out.write(("\n".join(RANK0_TRACEBACK) + "\n").encode())  # the OOM deep inside the log
        while out.tell() < 64 * 2**20:
            out.write(block)
        out.write((CHILD_FAILED + "\n").encode())
    started = time.monotonic()
    found = diagnose_files(1, [tmp_path / "stderr.log"])
    assert (found.status, found.oom_kind) == ("oom", "cuda")
    assert time.monotonic() - started < 40  # a few seconds idle; 5x on a loaded machine, and slack
