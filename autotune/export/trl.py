"""TRL's files: grpo_config.yaml (TrlParser's ``--config``) and launch.sh (accelerate launch)."""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from autotune import configs
from autotune.configs.trl import model_init_kwargs
from autotune.recipe import Recipe
from autotune.study.record import TrialRow


def fmt(value: float | None, digits: int = 3) -> str:
    """A figure for a comment or table: three significant digits, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}g}"


def gpu_list(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def grpo_yaml(params: dict[str, Any], recipe: Recipe, best: TrialRow) -> str:
    kwargs = configs.grpo_config_kwargs(params, recipe)
    init = model_init_kwargs(recipe)  # bf16 as the trials ran, and --quantization's BitsAndBytesConfig
    if init:
        kwargs["model_init_kwargs"] = init
    header = (
        f"# trl.GRPOConfig fields tuned by autotune (trial {best.number}).\n"
        "# Read by TrlParser (`--config grpo_config.yaml`); your script adds output_dir, dataset,\n"
        "# rewards and learning rate. TRL 1.x has no max_prompt_length: the search assumed prompts\n"
        f"# of at most {recipe.max_prompt_length} tokens, so keep them that short in your dataset.\n"
    )
    if recipe.quantization:
        header += (
            f"# The base loads {recipe.quantization} with bitsandbytes "
            "(model_init_kwargs.quantization_config; "
            "pip install bitsandbytes): QLoRA, so the LoRA below is required.\n"
        )
    if recipe.image_tokens:
        header += (
            f"# Prompts carry {recipe.images_per_prompt} image(s) of {recipe.image_tokens} tokens "
            "each on top of the text: larger images raise memory (vllm_max_model_length counts them).\n"
        )
    if recipe.lora_rank:
        header += (
            f"# LoRA rank {recipe.lora_rank} was tuned: give the trainer a peft LoraConfig(r="
            f"{recipe.lora_rank}) (ModelConfig: use_peft, lora_r); it is not a GRPOConfig field.\n"
        )
    return header + yaml.safe_dump(kwargs, sort_keys=False)


def launch_sh(params: dict[str, Any], recipe: Recipe, best: TrialRow, with_ds: bool) -> str:
    """launch.sh: runs from any working directory (files found next to the script).

    It does not ``cd``: the user's script and data paths stay relative to where they call it.
    ``--deepspeed_config_file`` on the command line overrides the absolute path in the YAML, so the
    folder may also be moved or copied to another machine.
    """
    train, server = configs.gpu_split(params, recipe)
    default_script = shlex.quote(recipe.train_script) if recipe.train_script else "''"
    lines = [
        "#!/usr/bin/env bash",
        f"# GRPO with TRL + accelerate, tuned by autotune (trial {best.number}: "
        f"{fmt(best.throughput)} completions/s).",
        "# usage: launch.sh TRAIN_SCRIPT [script args...]   "
        "(TRAIN_SCRIPT must parse --config with TrlParser)",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f"DEFAULT_TRAIN_SCRIPT={default_script}",
        'if [[ $# -ge 1 && "$1" != -* ]]; then',
        '  TRAIN_SCRIPT="$1"; shift',
        "else",
        '  TRAIN_SCRIPT="$DEFAULT_TRAIN_SCRIPT"',
        "fi",
        'if [[ -z "$TRAIN_SCRIPT" ]]; then',
        '  echo "usage: $0 TRAIN_SCRIPT [script args...]" >&2',
        "  exit 2",
        "fi",
    ]
    if recipe.device != "cpu":
        lines.append(f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{gpu_list(train)}}}"')
    if server:
        serve = " ".join(shlex.quote(t) for t in configs.vllm_serve_command(params, recipe, recipe.model))
        lines += [
            "# vLLM server mode: start the generation server on the other GPUs first, and wait until",
            "# `curl -sf http://localhost:8000/health/` answers:",
            f"#   CUDA_VISIBLE_DEVICES={gpu_list(server)} {serve} &",
        ]
    command = ['accelerate launch --config_file "$HERE/accelerate_config.yaml"']
    if with_ds:
        command.append('--deepspeed_config_file "$HERE/ds_config.json"')
    command.append('"$TRAIN_SCRIPT" --config "$HERE/grpo_config.yaml" "$@"')
    lines.append("exec " + " \\\n  ".join(command))
    return "\n".join(lines) + "\n"
