"""ZeRO-3 without vLLM on a GPU: what the memory model predicts against what the trial needed.

Read from an H200 run under the tensor probe (tests/data/gpu/zero3probe_*, docs/gpu-validation.md,
fifth lease). The trial's peak as autotune judges it (31.1 GiB, the device's used memory) counts two
allocator caches, one per CUDA stream: TRL gathers the model to generate on the default stream,
DeepSpeed fetches for training on its own, and torch reuses a cached block only on its own stream.
Before it raises an OOM the allocator frees every whole cached block of every stream, so the need is
what was allocated at once plus what lives outside torch's allocator; the model predicts that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.candidate.memory import estimate
from autotune.models import resolve_model

DATA = Path(__file__).parent / "data" / "gpu"
QWEN7 = resolve_model("Qwen2.5-7B")
PARAMS = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_generations": 4,
    "zero_stage": 3,
    "offload": "optimizer+params",
    "gradient_checkpointing": True,
    "use_vllm": False,
}


def _probe() -> list[dict]:
    lines = (DATA / "zero3probe_h200_qwen2.5-7b.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _need() -> float:
    """The most allocated at once over the trial, plus the device memory outside torch's allocator
    (used minus reserved) at the end of the last step."""
    rows = _probe()
    last = [r for r in rows if r["point"] == "step_end"][-1]["memory"]
    return (
        max(r["memory"]["max_allocated_gib"] for r in rows) + last["device_used_gib"] - last["reserved_gib"]
    )


def test_the_model_predicts_what_the_zero3_trial_needed_not_its_caches():
    outcome = json.loads((DATA / "zero3probe_h200_qwen2.5-7b.outcome.json").read_text())
    est = estimate(
        QWEN7,
        PARAMS,
        gpus=1,
        capacity_gib=140.4,
        max_prompt_length=128,
        max_completion_length=64,
        lora_rank=16,
    )
    need = _need()
    assert est.total_gib == pytest.approx(need, rel=0.15)
    # the judged peak is the caches' high-water mark, far above both
    assert outcome["peak_memory_gib"] > 1.6 * need
    assert outcome["peak_memory_gib"] > 1.6 * est.total_gib
