"""The trial's ``trl.GRPOConfig``: the candidate's kwargs plus what only a trial needs.

The candidate's kwargs come from the spec's ``grpo_config`` (the same function the export uses);
the worker adds :data:`TRIAL_ONLY_FIELDS`: a step limit, a log line per step, no checkpoints, no
reporting integrations, and EOS suppression so every completion is as long as the real run's
longest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TRIAL_ONLY_FIELDS", "build_grpo_config", "suppress_eos_kwargs"]

#: GRPOConfig fields the worker sets for every trial (the rest come from the candidate).
TRIAL_ONLY_FIELDS = (
    "output_dir",
    "max_steps",
    "logging_steps",
    "report_to",
    "save_strategy",
    "disable_tqdm",
    "seed",
    "dataloader_num_workers",
    "generation_kwargs",
)


def suppress_eos_kwargs(max_completion_length: int, use_vllm: bool) -> dict[str, Any]:
    """Generation kwargs that keep every completion running to ``max_completion_length``.

    TRL merges ``generation_kwargs`` into transformers' GenerationConfig or into vLLM's
    SamplingParams, whose names differ: ``min_new_tokens`` masks the EOS ids in transformers,
    ``min_tokens`` does the same (stop tokens included) in vLLM.
    """
    if use_vllm:
        return {"min_tokens": int(max_completion_length)}
    return {"min_new_tokens": int(max_completion_length)}


def build_grpo_config(spec: dict[str, Any]) -> Any:
    """The ``trl.GRPOConfig`` of this trial: the candidate's kwargs plus the trial-only fields.

    Built before the model on purpose: under ``accelerate launch`` with DeepSpeed, creating the
    TrainingArguments activates transformers' DeepSpeed config, so a ZeRO-3 model built afterwards
    is partitioned as it is created, as in a real run.
    """
    from trl import GRPOConfig

    kwargs = dict(spec["grpo_config"])
    trial_dir = Path(spec["trial_dir"])
    generation = dict(kwargs.get("generation_kwargs") or {})
    generation.update(suppress_eos_kwargs(spec["max_completion_length"], bool(kwargs.get("use_vllm"))))
    kwargs.update(
        output_dir=str(trial_dir / "out"),
        max_steps=int(spec["max_steps"]),
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,  # PrinterCallback: one plain dict line per step on stdout
        seed=int(spec.get("seed", 0)),
        dataloader_num_workers=0,  # prompts are tiny; workers would only add processes to kill
        generation_kwargs=generation,
    )
    production = spec.get("production")
    if production:  # `autotune run`: checkpoints in the attempt's folder, every save_steps
        kwargs.update(
            output_dir=str(trial_dir), save_strategy="steps", save_steps=int(production["save_steps"])
        )
    if spec["device"] == "cpu":
        kwargs.update(use_cpu=True, bf16=False)
    return GRPOConfig(**kwargs)
