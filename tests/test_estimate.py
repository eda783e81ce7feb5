"""autotune estimate through the real CLI: exit status, what-if pins, the uncertainty it prints."""

import json

from tests.conftest import run_cli

H100 = ["estimate", "--model", "Qwen2.5-1.5B", "--gpus", "1", "--gpu-type", "H100-80GB",
        "--max-prompt-length", "512", "--max-completion-length", "256"]
B0 = ["--set", "use_vllm=false", "--set", "per_device_train_batch_size=16", "--set", "gradient_accumulation_steps=1",
      "--set", "num_generations=4", "--set", "gradient_checkpointing=false", "--set", "zero_stage=0",
      "--set", "offload=none"]


def test_fits_exits_0_and_prints_uncertainty_and_warns_outside_the_space():
    # use_vllm=false is outside the shipped space (it offers only true): estimated, with a warning
    res = run_cli(*H100, *B0)
    assert res.returncode == 0, res.stderr
    assert "use_vllm=false is outside the space" in res.stderr
    assert "fits: 51.8 of 79.3 GiB" in res.stdout          # measured 49.5 GiB on an H100
    assert "uncertainty +/-6%" in res.stdout
    assert "generate() over 16 sequences" in res.stdout


def test_does_not_fit_exits_1():
    # bs=32 at ZeRO 0 hit a CUDA OOM on the H100 (docs/gpu-validation.md, V2)
    res = run_cli(*H100, *B0, "--set", "per_device_train_batch_size=32", "--json")
    assert res.returncode == 1, res.stderr
    data = json.loads(res.stdout)
    assert data["fits"] is False and data["typical_rel_error"] == 0.06
    assert data["params"]["per_device_train_batch_size"] == 32


def test_value_outside_the_space_of_the_right_type_is_estimated():
    res = run_cli(*H100, *B0, "--set", "per_device_train_batch_size=6", "--set", "num_generations=3", "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("is outside the space") == 3      # use_vllm, batch 6, 3 generations
    assert json.loads(res.stdout)["params"]["num_generations"] == 3


def test_bad_input_exits_2_with_one_line():
    for pins, fragment in ((["--set", "per_device_train_batch_size=abc"], "takes int values"),
                           (["--set", "batch=4"], "unknown parameter"),
                           (["--set", "num_generations=3"], "not divisible by num_generations 3"),
                           (["--set", "offload=disk"], "offload 'disk' is not none")):
        res = run_cli(*H100, *pins)
        assert res.returncode == 2, (pins, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (pins, res.stderr)
