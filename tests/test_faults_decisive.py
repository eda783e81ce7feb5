"""Issue 22, item 2: the decisive error is the last exception that ended the process.

A trainer that prints a user prompt quoting a memory error and then dies of something else
crashed; it did not run out of memory. A real OOM, alone, chained under another exception, or
followed by a launcher's teardown, still is one. Every trial runs through the real execute() (its
own process group, logs teed to files, judged from the files), the texts are the real ones of
tests/test_faults_logs.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import CHILD_FAILED, CUDA_OOM, RANK0_TRACEBACK, noise, run_cli, run_script_trial, trainer

from autotune.trial.classify import classify_failure

PROMPT = [  # a data loader echoing a bad sample: a user's prompt that quotes an error text
    "WARNING: sample 812 looks odd, prompt follows:",
    "Why does my script print torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB?",
    CUDA_OOM,
]
VALUE_ERROR = [
    "Traceback (most recent call last):",
    '  File "/workspace/train_grpo.py", line 44, in <module>',
    "    raise ValueError(f'reward function returned {len(r)} rewards for {n} completions')",
    "ValueError: reward function returned 3 rewards for 8 completions",
]
CHAINED_OOM = [
    "Traceback (most recent call last):",
    '  File "/workspace/train_grpo.py", line 91, in <module>',
    "    trainer.train()",
    CUDA_OOM,
    "",
    "{separator}",
    "",
    "Traceback (most recent call last):",
    '  File "/workspace/train_grpo.py", line 95, in <module>',
    "    raise RuntimeError('training failed') from exc",
    "RuntimeError: training failed",
]


@pytest.mark.parametrize("where", ["stdout", "stderr"])
def test_a_quoted_memory_error_before_a_value_error_is_a_crash_with_the_value_error(
    tmp_path: Path, where: str
) -> None:
    logs = (
        {"stdout": PROMPT, "stderr": VALUE_ERROR} if where == "stdout" else {"stderr": PROMPT + VALUE_ERROR}
    )
    outcome = run_script_trial(tmp_path, trainer(logs["stderr"], stdout=logs.get("stdout", [])))
    assert (outcome.status, outcome.oom_kind) == ("crash", None), outcome
    assert outcome.error_line == "ValueError: reward function returned 3 rewards for 8 completions"


def test_a_quoted_memory_error_then_a_crash_behind_torchrun_teardown_is_a_crash(tmp_path: Path) -> None:
    crash = ["[rank0]: " + line for line in VALUE_ERROR]
    outcome = run_script_trial(
        tmp_path, trainer(crash + noise(300) + CHILD_FAILED.splitlines(), stdout=PROMPT)
    )
    assert outcome.status == "crash" and outcome.error_line.startswith("ValueError: reward function"), outcome


@pytest.mark.parametrize(
    "separator",
    [
        "During handling of the above exception, another exception occurred:",
        "The above exception was the direct cause of the following exception:",
    ],
)
def test_an_oom_chained_under_another_exception_stays_oom(tmp_path: Path, separator: str) -> None:
    lines = [line.format(separator=separator) for line in CHAINED_OOM]
    outcome = run_script_trial(tmp_path, trainer(lines))
    assert (outcome.status, outcome.oom_kind) == ("oom", "cuda"), outcome
    assert outcome.error_line.startswith("torch.OutOfMemoryError: CUDA out of memory")


def test_a_quoted_memory_error_then_a_real_oom_is_oom(tmp_path: Path) -> None:
    outcome = run_script_trial(tmp_path, trainer(RANK0_TRACEBACK + CHILD_FAILED.splitlines(), stdout=PROMPT))
    assert (outcome.status, outcome.oom_kind) == ("oom", "cuda"), outcome


def test_the_in_memory_classifier_agrees() -> None:
    """classify_failure over one text (the sim and the production supervisor use it)."""
    assert classify_failure(1, "\n".join(PROMPT + VALUE_ERROR))[:2] == ("crash", None)
    assert classify_failure(1, "\n".join(PROMPT + RANK0_TRACEBACK))[:2] == ("oom", "cuda")


# --- item 3: unusable measurements are the reason, said where people look -------------------

BAD_METRICS_SCRIPT = """\
import os, sys, time
with open(os.environ["AUTOTUNE_METRICS_FILE"], "a") as out:
    for step, value in enumerate(["NaN", "Infinity", "-0.5", "NaN", "-Infinity", "-2", "NaN", "Infinity"], 1):
        out.write('{"step": %d, "step_time": %s, "samples": 64}\\n' % (step, value))
        out.flush()
        print("step %d done" % step, flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def test_unusable_step_times_are_the_recorded_reason(tmp_path: Path) -> None:
    outcome = run_script_trial(tmp_path, BAD_METRICS_SCRIPT)
    assert outcome.status == "crash", outcome
    line = outcome.error_line or ""
    assert "step done" not in line and "rejected" in line, line
    assert "nan" in line.lower() and "8" in line, line


def test_show_prints_the_reason_of_unusable_step_times(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(BAD_METRICS_SCRIPT)
    common = ("--model", "Qwen2.5-0.5B", "--gpus", "1", "--gpu-type", "A10G", "--device", "cpu")
    command = f"{sys.executable} t.py 0 {{per_device_train_batch_size}}"
    res = run_cli(
        "search",
        *common,
        "--command",
        command,
        "--trials",
        "1",
        "--confirm",
        "0",
        "--name",
        "nan",
        cwd=tmp_path,
        timeout=600,
    )
    assert res.returncode in (0, 1), res.stderr
    shown = run_cli("show", "nan", cwd=tmp_path, timeout=300)
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if "crash" in line)
    assert "rejected" in row and "step 8 done" not in row, shown.stdout
