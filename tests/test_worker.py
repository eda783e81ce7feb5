"""Real TRL GRPO trials on CPU, launched the way the controller launches them.

Each trial goes TrlRunner.prepare -> launcher.launch (own process group, RLIMIT_AS when asked)
-> ``python -m autotune.worker`` or ``accelerate launch -m autotune.worker``, with tiny-qwen:
two small layers but Qwen's real 151,936-token vocabulary.
"""

from __future__ import annotations

import ast
import re

import pytest
from conftest import COMPLETION, PROMPT, params, run_trial

from autotune.models import resolve_model

pytestmark = pytest.mark.slow


def trl_logs(trial_dir):
    """TRL's per-step log dicts as the PrinterCallback prints them (values are strings)."""
    logs = []
    for line in (trial_dir / "stdout.log").read_text().splitlines():
        if line.startswith("{'loss'"):
            logs.append(ast.literal_eval(line))
    return logs


def test_real_grpo_trial_on_cpu_writes_metrics(recipe_factory, tmp_path):
    # beta > 0: TRL builds a reference model from the policy's path, which has no weights here
    result, trial_dir, lines = run_trial(recipe_factory, tmp_path, params(2, 2, 2), beta=0.04)
    assert result.returncode == 0, result.stderr_tail[-3000:]
    stdout = (trial_dir / "stdout.log").read_text()
    assert len(re.findall(r"random weights \(shape-only", stdout)) == 1
    assert "reference model: random weights" in stdout
    assert len(lines) >= 3
    for line in lines:
        assert line["step_time"] > 0 and line["samples"] == 2 * 2
        # every prompt exactly 32 tokens and every completion 16: TRL's own token count agrees
        assert line["tokens"] == line["samples"] * (PROMPT + COMPLETION)
        assert line["completion_length"] == COMPLETION and line["clipped_ratio"] == 1.0
        assert line["peak_memory_gib"] > 0.1 and line["memory_kind"] == "host_rss"
        assert 0 < line["generation_time"] < line["step_time"]
    assert [m["step"] for m in lines] == list(range(1, len(lines) + 1))
    logs = trl_logs(trial_dir)
    assert len(logs) == len(lines)
    assert all(float(log["completions/mean_length"]) == COMPLETION for log in logs)
    assert all(float(log["completions/clipped_ratio"]) == 1.0 for log in logs)
    assert all("kl" in log and "step_time" in log for log in logs)


def test_real_host_oom_under_memory_limit(recipe_factory, tmp_path):
    # 3 GiB of address space: enough for torch + trl + a small batch (which needs about 2.5),
    # not for 64 completions of Qwen's vocabulary in the log-prob forward
    result, trial_dir, lines = run_trial(recipe_factory, tmp_path, params(64, 1, 4), memory_limit_gib=3.0)
    stderr = (trial_dir / "stderr.log").read_text()
    assert result.returncode not in (0, None)
    assert "DefaultCPUAllocator: can't allocate memory" in stderr, stderr[-3000:]
    assert lines == []


def test_two_process_trial_through_accelerate(recipe_factory, tmp_path):
    result, trial_dir, lines = run_trial(recipe_factory, tmp_path, params(2, 1, 2), gpus=2)
    assert result.returncode == 0, result.stderr_tail[-3000:]
    stdout = (trial_dir / "stdout.log").read_text()
    assert stdout.count("2 process(es)") == 1 and stdout.count("random weights (shape-only") == 1
    expected_steps = 1 + 1 + 2
    assert [m["step"] for m in lines] == list(range(1, expected_steps + 1))  # once per step, rank 0 only
    assert all(m["samples"] == 2 * 1 * 2 for m in lines)
    assert all(m["tokens"] == m["samples"] * (PROMPT + COMPLETION) for m in lines)
    assert len(trl_logs(trial_dir)) == expected_steps


def test_model_with_weights_lora_dataset_and_eos_suppression(recipe_factory, tmp_path):
    """A checkpoint on disk (weights + its own tokenizer) with a vocabulary of 8 tokens.

    With 8 tokens a random model samples EOS about once in 8 tokens, so without suppression
    nearly every 16-token completion would stop early; they must all run to the full length.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotune.worker.tokenizer import synthetic_tokenizer

    config = dict(resolve_model("tiny-qwen").config, vocab_size=8, eos_token_id=7, bos_token_id=6)
    model_dir = tmp_path / "ckpt"
    torch.manual_seed(0)
    shape = {k: v for k, v in config.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **shape))
    model.save_pretrained(str(model_dir))
    synthetic_tokenizer(config).save_pretrained(str(model_dir))
    assert resolve_model(str(model_dir)).has_weights
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "t1 t2 t3"}\n{"prompt": "' + " ".join(["t4"] * 50) + '"}\n')

    result, trial_dir, lines = run_trial(
        recipe_factory, tmp_path, params(4, 1, 4), model=str(model_dir), lora_rank=4, dataset=str(dataset)
    )
    assert result.returncode == 0, result.stderr_tail[-3000:]
    assert "shape-only" not in (trial_dir / "stdout.log").read_text()
    assert len(lines) >= 3
    for line in lines:
        assert line["clipped_ratio"] == 1.0 and line["completion_length"] == COMPLETION
        assert line["tokens"] == 4 * (PROMPT + COMPLETION)
