"""Every user mistake gets one line starting with 'error:' and exit status 2, never a traceback."""

import json
import os
import sys

import pytest
from conftest import one_line_error, run_cli

BASE = [
    "search",
    "--model",
    "Qwen2.5-7B-Instruct",
    "--gpus",
    "4",
    "--runner",
    "sim",
    "--gpu-type",
    "A100-80GB",
    "--trials",
    "1",
]


def replace(args, flag, value):
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize(
    "args,fragments",
    [
        (
            replace(BASE, "--model", "Mistral-Large-9000"),
            ("unknown model 'Mistral-Large-9000'", "Qwen2.5-7B", "config.json"),
        ),
        (replace(BASE, "--gpu-type", "B300"), ("unknown GPU type 'B300'", "A100-80GB")),
        (replace(BASE, "--gpus", "0"), ("--gpus must be at least 1",)),
        (BASE + ["--set", "batch=4"], ("--set batch: unknown parameter", "per_device_train_batch_size")),
        (
            BASE + ["--set", "num_generations=3"],
            ("num_generations=3 is out of range", "one of 2, 4, 8, 16", "--space"),
        ),
        (BASE + ["--set", "vllm_gpu_memory_utilization=1.5"], ("out of range",)),
        (BASE + ["--set", "num_generations"], ("NAME=VALUE",)),
        (
            replace(BASE, "--gpus", "1")
            + ["--set", "per_device_train_batch_size=1", "--set", "gradient_accumulation_steps=1"],
            ("no valid candidate", "divisible by num_generations"),
        ),
        (
            BASE + ["--global-batch", "24", "--set", "per_device_train_batch_size=4"],
            ("no valid candidate", "--global-batch"),
        ),
        (BASE + ["--time-budget", "tonight"], ("cannot read duration 'tonight'",)),
        (BASE + ["--headroom", "5"], ("--headroom",)),
        (
            [
                "search",
                "--model",
                "Qwen2.5-7B",
                "--gpus",
                "1",
                "--gpu-type",
                "A10G",
                "--command",
                "no-such-trainer --bs {per_device_train_batch_size}",
            ],
            ("program 'no-such-trainer' was not found",),
        ),
        (
            [
                "search",
                "--model",
                "Qwen2.5-7B",
                "--gpus",
                "1",
                "--gpu-type",
                "A10G",
                "--command",
                f"{sys.executable} t.py --bs {{batch}}",
            ],
            ("placeholder {batch} names nothing", "per_device_train_batch_size"),
        ),
        (["resume", "never-ran"], ("no study 'never-ran'",)),
        (["show", "never-ran"], ("no study 'never-ran'",)),
    ],
)
def test_bad_flags(tmp_path, args, fragments):
    one_line_error(run_cli(*args, cwd=tmp_path), *fragments)


def test_no_gpu_and_no_description(tmp_path):
    res = run_cli("search", "--model", "Qwen2.5-7B", "--gpus", "2", "--runner", "sim", cwd=tmp_path)
    one_line_error(res, "no GPU is visible", "--gpu-type")


@pytest.mark.parametrize(
    "text,fragments",
    [
        (
            "parameters:\n  zero_stage:\n    type: int\n    choices: [0, 1\n",
            (":5:", "invalid YAML", "at line 4"),
        ),
        (
            "parameters:\n  zero_stage:\n    type: int\n    choices: [0, 3]\n    default: 2\n",
            (":5:", "zero_stage.default 2"),
        ),
    ],
)
def test_broken_space_file(tmp_path, text, fragments):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    one_line_error(run_cli(*BASE, "--space", space, cwd=tmp_path), str(space), *fragments)


def test_existing_study_with_other_recipe(tmp_path):
    first = run_cli(*BASE, "--name", "s", "--sim-time-scale", "0.0005", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    res = run_cli(*replace(BASE, "--gpus", "8"), "--name", "s", cwd=tmp_path)
    one_line_error(res, "already exists with a different recipe", "gpus", "autotune resume s")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_runs_dir_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    one_line_error(run_cli(*BASE, "--runs-dir", ro, cwd=tmp_path), "cannot write", "--runs-dir")


def test_runs_dir_is_a_file(tmp_path):
    blocker = tmp_path / "runs-file"
    blocker.write_text("")
    one_line_error(run_cli(*BASE, "--runs-dir", blocker, cwd=tmp_path), "cannot write", "--runs-dir")


def test_more_gpus_than_visible(monkeypatch):
    """NVML is faked here (no GPU on CI); the rule is what is tested."""
    from autotune import hardware
    from autotune.errors import UsageError

    monkeypatch.setattr(
        hardware, "visible_gpus", lambda: [hardware.VisibleGpu(0, "NVIDIA A100-SXM4-80GB", 79.3)]
    )
    with pytest.raises(UsageError, match="--gpus 4 but only 1 GPU"):
        hardware.resolve_hardware(4, None, None, need_visible=True)
    gpu = hardware.resolve_hardware(1, None, None, need_visible=True)
    assert gpu.name == "A100-80GB" and gpu.memory_gib == 79.3


def test_bad_numbers_and_names(tmp_path):
    one_line_error(run_cli(*BASE, "--gpu-memory", "-5", cwd=tmp_path), "--gpu-memory")
    one_line_error(run_cli(*BASE, "--lora-rank", "0", cwd=tmp_path), "--lora-rank")
    one_line_error(run_cli(*BASE, "--beta", "-1", cwd=tmp_path), "--beta")
    one_line_error(run_cli(*BASE, "--name", "../escape", cwd=tmp_path), "--name")
    assert not (tmp_path / "escape").exists()


def test_space_log_and_step_together(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(
        "parameters:\n  a:\n    type: float\n    low: 0.1\n    high: 0.9\n    step: 0.1\n    log: true\n"
        "    default: 0.1\n"
    )
    one_line_error(run_cli(*BASE, "--space", space, cwd=tmp_path), "either log or step")


def test_verify_with_a_broken_params_file(tmp_path):
    first = run_cli(
        *replace(BASE, "--trials", "3"),
        "--name",
        "v",
        "--sim-time-scale",
        "0.0005",
        "--confirm",
        "0",
        "--set",
        "offload=optimizer+params",
        "--set",
        "per_device_train_batch_size=2",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    params = tmp_path / "runs" / "v" / "best" / "params.json"
    if not params.exists():
        pytest.skip("the single trial did not fit; nothing exported")
    params.write_text("{not json")
    one_line_error(run_cli("verify", "v", cwd=tmp_path), "not valid JSON", "autotune export v")
    good = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "num_generations": 8,
        "zero_stage": 3,
        "offload": "optimizer+params",
        "gradient_checkpointing": True,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.3,
        "vllm_enable_sleep_mode": False,
        "vllm_tensor_parallel_size": 1,
    }
    params.write_text(json.dumps({**good, "zero_stage": 7}))
    one_line_error(run_cli("verify", "v", cwd=tmp_path), "zero_stage=7", "one of 0, 1, 2, 3")
    params.write_text(json.dumps({**good, "gradient_accumulation_steps": 1, "num_generations": 16}))
    one_line_error(run_cli("verify", "v", cwd=tmp_path), "cannot run here", "divisible by num_generations")


def test_real_trials_without_a_gpu_say_what_to_do(tmp_path):
    res = run_cli("search", "--model", "Qwen2.5-7B-Instruct", "--gpus", "4", cwd=tmp_path)
    one_line_error(res, "no GPU is visible for real TRL trials", "--device cpu", "--runner sim")
