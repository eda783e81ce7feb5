"""The trial's reward: cheap, and never constant.

A tuning trial measures memory and speed, not learning, so the reward must cost nothing next to
generation and training. It must still vary within each prompt group: GRPO normalises rewards per
group, and a constant reward gives zero advantages, which lets a trainer skip work (and makes the
loss identically zero). Completions in a trial all run to the same length, so length alone would be
constant; a little noise makes every group's standard deviation non-zero.

Defined at module level so it pickles (dataloader workers, ``accelerate launch`` processes).
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["length_noise_reward"]

_rng = random.Random(0)


def length_noise_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Completion length in thousands of characters plus uniform noise in [0, 1)."""
    return [len(str(completion)) / 1000.0 + _rng.random() for completion in completions]
