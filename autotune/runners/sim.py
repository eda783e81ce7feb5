"""The simulator runner: launches ``python -m autotune.sim`` through the same path as real trials.

The simulated trainer imitates a GRPO run on the described hardware (same log lines, same OOM
text, time-compressed), so a whole search can be rehearsed, tested and benchmarked without GPUs.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from autotune.runners.base import Runner, TrialContext
from autotune.trial.launch import LaunchSpec


def run_seed(seed: int, number: int, attempt: int = 0) -> int:
    """The simulator's seed for one run. A run of the same number again (a confirmation re-run
    after a transient crash) is another run, as on a real machine: its noise and its crash are drawn
    anew, where the same seed would replay the first run's crash exactly."""
    return zlib.crc32(f"{seed}:{number}".encode() + (f":{attempt}".encode() if attempt else b""))


class SimRunner(Runner):
    name = "sim"
    monitors_gpus = False

    def __init__(self, context: TrialContext) -> None:
        super().__init__(context)
        self._launched: Counter[int] = Counter()  # runs started per trial number by this runner

    def attempt(self, number: int) -> int:
        """How many runs of trial ``number`` this runner started before (and count this one)."""
        self._launched[number] += 1
        return self._launched[number] - 1

    def build_spec(
        self, params: dict[str, Any], number: int, steps_needed: int | None = None, attempt: int = 0
    ) -> dict[str, Any]:
        """The simulator's input for one trial (also used in-process by the benchmark); ``attempt``
        counts earlier runs of the same number (a confirmation run again after a transient crash)."""
        recipe = self.recipe
        return {
            "params": params,
            "recipe": {
                "gpus": recipe.gpus,
                "max_prompt_length": recipe.max_prompt_length,
                "max_completion_length": recipe.max_completion_length,
                "beta": recipe.beta,
                "lora_rank": recipe.lora_rank,
                "quantization": recipe.quantization,
                "image_tokens": recipe.image_tokens * recipe.images_per_prompt,
                "host_memory_gib": max(256, 128 * recipe.gpus),
            },
            "model_config": self.context.model.config,
            "gpu": self.context.gpu.to_json(),
            # noise differs between trials, but a study replays identically from its seed
            "seed": run_seed(recipe.seed, number, attempt),
            "time_scale": recipe.sim_time_scale,
            "warmup_steps": recipe.warmup_steps,
            "max_steps": max(50, recipe.warmup_steps + recipe.measure_steps + 20, (steps_needed or 0) + 2),
        }

    def prepare(
        self, params: dict[str, Any], trial_dir: Path, number: int, steps_needed: int | None = None
    ) -> LaunchSpec:
        recipe = self.recipe
        spec = self.build_spec(params, number, steps_needed, self.attempt(number))
        trial_dir.mkdir(parents=True, exist_ok=True)
        spec_path = trial_dir / "sim_spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        return LaunchSpec(
            argv=[sys.executable, "-m", "autotune.sim", "--spec", str(spec_path)],
            env=self.base_env(trial_dir),
            trial_dir=trial_dir,
            memory_limit_gib=recipe.memory_limit_gib,
        )
