"""ZeRO-3 without vLLM: the weights gathered to generate stay reserved through training.

Read from an H200 run under the tensor probe (tests/data/gpu/zero3probe_*, docs/gpu-validation.md,
fifth lease): TRL gathers the whole model on the default CUDA stream to generate, DeepSpeed fetches
parameters for training on its own stream, and torch's caching allocator reuses a freed block only
on the stream that allocated it, so the peak holds two pools although no more than one gathered
copy is ever allocated at once.
"""

from __future__ import annotations

import json
from pathlib import Path

from autotune.candidate.memory import ZERO3_MAX_LIVE_PARAMS, estimate
from autotune.models import resolve_model
from autotune.units import GIB

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


def _at(point: str, step: int) -> dict:
    return next(r for r in _probe() if r["point"] == point and r["step"] == step)


def _estimate(**overrides) -> object:
    return estimate(
        QWEN7,
        {**PARAMS, **overrides},
        gpus=1,
        capacity_gib=140.4,
        max_prompt_length=128,
        max_completion_length=64,
        lora_rank=16,
    )


def test_the_h200_run_held_two_pools_for_one_gathered_copy():
    gathered = 2 * QWEN7.num_params / GIB
    step = _at("step_end", 1)
    pools = step["allocator"]["segments_by_stream_gib"]
    default = pools.pop("0")[0]
    deepspeed = max(total for total, _ in pools.values())
    assert step["memory"]["max_allocated_gib"] < 1.1 * gathered  # one copy at a time
    assert default > 0.95 * gathered and deepspeed > 0.9 * gathered  # two reserved pools
    assert step["memory"]["reserved_gib"] > 1.9 * gathered
    # the generation's pool was there before training began, and nothing on the default stream
    # was left allocated in it
    before = _at("generate_exit", 0)["allocator"]["segments_by_stream_gib"]
    assert before["0"][0] > 0.95 * gathered and before["0"][1] < 0.1 * gathered


def test_the_model_puts_the_generation_pool_in_the_training_phase():
    measured = json.loads((DATA / "zero3probe_h200_qwen2.5-7b.outcome.json").read_text())
    default_pool = _at("step_end", 1)["allocator"]["segments_by_stream_gib"]["0"][0]
    est = _estimate()
    training = (
        est.model_states_gib + est.activations_gib + est.logits_gib + est.reference_gib + est.overhead_gib
    )
    # the training phase holds the default stream's measured pool and at least the fetches the
    # model counts beside it (it does not yet reach the whole model DeepSpeed's stream held)
    assert training >= default_pool + 2 * ZERO3_MAX_LIVE_PARAMS / GIB
    assert est.total_gib <= measured["peak_memory_gib"]
    assert any("stay reserved through training" in note for note in est.notes)


def test_the_pool_is_the_training_phase_s_only_where_it_is_not_reused_or_absent():
    # colocated vLLM generates in its own memory: nothing gathered to generate
    with_vllm = _estimate(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    assert not any("stay reserved" in note for note in with_vllm.notes)
    # ZeRO-2 gathers nothing
    assert not any("stay reserved" in note for note in _estimate(zero_stage=2, offload="optimizer").notes)
    # activations and logits larger than the weights reuse the generation's blocks
    big = estimate(
        QWEN7,
        {**PARAMS, "per_device_train_batch_size": 64, "gradient_checkpointing": False},
        gpus=1,
        capacity_gib=140.4,
        max_prompt_length=1024,
        max_completion_length=1024,
        lora_rank=16,
    )
    assert big.activations_gib + big.logits_gib > 2 * QWEN7.num_params / GIB
    assert not any("stay reserved" in note for note in big.notes)
