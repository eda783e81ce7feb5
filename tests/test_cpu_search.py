"""A real search on CPU: real TRL GRPO trials with tiny-qwen, real out-of-memory under RLIMIT_AS,
a real export, and `autotune verify` replaying it. Slow (minutes), run in CI."""

import json

import pytest
import yaml
from conftest import run_cli

SPACE = {
    "version": 1,
    "parameters": {
        # 64 completions of 32+16 tokens x Qwen's 152k vocabulary do not fit in 3 GiB; 4 do
        "per_device_train_batch_size": {"type": "int", "choices": [4, 64], "default": 4},
        "gradient_accumulation_steps": {"type": "int", "choices": [1], "default": 1},
        "num_generations": {"type": "int", "choices": [4], "default": 4},
        "zero_stage": {"type": "int", "choices": [0, 3], "default": 0},
        "offload": {"type": "categorical", "choices": ["none"], "default": "none"},
        "gradient_checkpointing": {"type": "bool", "choices": [True], "default": True},
        "use_vllm": {"type": "bool", "choices": [True, False], "default": False},
    },
}


@pytest.mark.slow
def test_real_cpu_search_meets_real_oom_exports_and_verifies(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    res = run_cli(
        "search",
        "--model",
        "tiny-qwen",
        "--gpus",
        "1",
        "--device",
        "cpu",
        "--memory-limit",
        "3",
        "--runner",
        "trl",
        "--max-prompt-length",
        "32",
        "--max-completion-length",
        "16",
        "--space",
        space,
        "--trials",
        "2",
        "--warmup-steps",
        "1",
        "--measure-steps",
        "2",
        "--confirm",
        "1",
        "--name",
        "cpu",
        cwd=tmp_path,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    study = tmp_path / "runs" / "cpu"
    outcomes = {int(p.parent.name): json.loads(p.read_text()) for p in study.glob("trials/*/outcome.json")}
    launched = {n: o for n, o in outcomes.items() if o.get("launched")}
    assert len(launched) == 2
    by_batch = {
        json.loads((study / "trials" / str(n) / "params.json").read_text())["per_device_train_batch_size"]: o
        for n, o in launched.items()
    }
    assert by_batch[64]["status"] == "oom" and by_batch[64]["oom_kind"] == "host"
    assert "DefaultCPUAllocator: can't allocate memory" in by_batch[64]["error_line"]
    assert by_batch[4]["status"] == "ok" and by_batch[4]["throughput"] > 0
    # vLLM cannot run on CPU: that value was fixed by the rules, never launched (ZeRO can:
    # tests/test_deepspeed_cpu.py)
    params = [json.loads(p.read_text()) for p in study.glob("trials/*/params.json")]
    assert all(p["use_vllm"] is False for p in params)
    best = json.loads((study / "best" / "params.json").read_text())
    assert best["per_device_train_batch_size"] == 4
    cfg = yaml.safe_load((study / "best" / "grpo_config.yaml").read_text())
    assert cfg["per_device_train_batch_size"] == 4 and cfg.get("use_cpu") is True
    assert (study / "confirm").exists()
    verify = run_cli("verify", "cpu", "--steps", "2", cwd=tmp_path, timeout=900)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "held: yes" in verify.stdout and "completions/s" in verify.stdout
    (v,) = list(study.glob("verify/*/outcome.json"))
    assert json.loads(v.read_text())["status"] == "ok"
    # a configuration that runs out of memory does not hold, and the verdict says why
    (study / "best" / "params.json").write_text(json.dumps({**best, "per_device_train_batch_size": 64}))
    oom = run_cli("verify", "cpu", "--steps", "2", cwd=tmp_path, timeout=900)
    assert oom.returncode == 1, oom.stdout + oom.stderr
    assert "held: NO (the run failed: oom/host)" in oom.stdout
