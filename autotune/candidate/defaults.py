"""TRL's GRPOConfig defaults for the tuned fields: the one table every reader of a candidate uses.

A candidate that lacks a knob (a space without it, a seed that leaves it out) runs with TRL's
value, so the memory model, the speed prior, the rules and the shipped config must all read the
same number. It lives with the candidate model, below ``configs/`` (which writes it out for TRL
and ms-swift), so that none of them spells out an 8 of its own; tests check it against the real
GRPOConfig dataclass (trl 1.16).
"""

from __future__ import annotations

from typing import Any

TRL_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
    "gradient_checkpointing": True,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_enable_sleep_mode": False,
    "vllm_tensor_parallel_size": 1,
}


def knob(params: dict[str, Any], name: str) -> Any:
    """The candidate's value of a TRL knob, or TRL's default when the candidate lacks it."""
    return params.get(name, TRL_DEFAULTS[name])
