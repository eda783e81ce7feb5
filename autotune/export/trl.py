"""TRL's files: grpo_config.yaml (TrlParser's ``--config``) and launch.sh (accelerate launch)."""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from autotune import configs
from autotune.configs.trl import model_init_kwargs
from autotune.export.model import export_model
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
        "# Read by TrlParser (`--config grpo_config.yaml`, launch.sh passes it); the model, dataset,\n"
        "# rewards, output_dir and learning rate are flags. TRL 1.x has no max_prompt_length: the search\n"
        f"# assumed prompts of at most {recipe.max_prompt_length} tokens: keep your prompts that short.\n"
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
        lora = configs.lora_adapter(int(recipe.lora_rank))
        header += (
            f"# The trials trained LoRA r={lora['r']}, alpha={lora['lora_alpha']}, "
            f"target_modules={lora['target_modules']}, dropout={lora['lora_dropout']}: not GRPOConfig\n"
            "# fields; launch.sh passes them to TRL's script as ModelConfig flags (--use_peft --lora_r\n"
            "# --lora_alpha --lora_target_modules --lora_dropout); give your trainer the same LoraConfig.\n"
        )
    return header + yaml.safe_dump(kwargs, sort_keys=False)


#: TRL's script loads ``--dataset_name`` with ``datasets.load_dataset``, which reads a hub id or a
#: folder but not a single local file ("Couldn't find any data file at data.jsonl"): a file is linked
#: as the train split of a folder of its own, removed when the run ends.
LOCAL_DATA = [
    "ARGS=()",
    "DATA_DIR=",
    "while [[ $# -gt 0 ]]; do",
    '  if [[ "$1" == --dataset_name && $# -ge 2 && -f "$2" ]]; then',
    '    DATA_DIR="$(mktemp -d)"',
    '    ln -s "$(realpath "$2")" "$DATA_DIR/train.${2##*.}"',
    '    ARGS+=("$1" "$DATA_DIR"); shift 2',
    "  else",
    '    ARGS+=("$1"); shift',
    "  fi",
    "done",
    'trap \'[[ -z "$DATA_DIR" ]] || rm -rf "$DATA_DIR"\' EXIT',
]


def launch_sh(params: dict[str, Any], recipe: Recipe, best: TrialRow, with_ds: bool) -> str:
    """launch.sh: runs from any working directory (files found next to the script).

    By default it runs TRL's own GRPO script (``python -m trl.scripts.grpo``, what ``trl grpo``
    runs), so ``launch.sh --dataset_name D --reward_funcs R --output_dir O`` trains as it is; a
    first argument that is not a flag is the user's own TrlParser script instead. The model and the
    measured LoRA adapter are ``trl.ModelConfig`` flags (:func:`autotune.configs.model_flags`),
    passed before the caller's arguments so that those win. It does not ``cd``: the user's paths
    stay relative to where they call it. ``--deepspeed_config_file`` on the command line overrides
    the absolute path in the YAML, so the folder may also be moved or copied to another machine.
    """
    train, server = configs.gpu_split(params, recipe)
    model = export_model(recipe)
    # accelerate launch -m: TRL's script as a module, found in whatever environment runs accelerate
    default = ["-m", "trl.scripts.grpo"] if not recipe.train_script else [recipe.train_script]
    lines = [
        "#!/usr/bin/env bash",
        f"# GRPO with TRL + accelerate, tuned by autotune (trial {best.number}: "
        f"{fmt(best.throughput)} completions/s).",
        "# usage: launch.sh [TRAIN_SCRIPT] --dataset_name DATA --reward_funcs R [--output_dir O ...]",
        "#   TRAIN_SCRIPT defaults to TRL's own GRPO script (trl grpo); yours must parse --config and",
        "#   trl.ModelConfig's flags with TrlParser. DATA: a hub dataset, a local folder or a .jsonl file",
        "#   with a 'prompt' column (datasets.load_dataset reads it).",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f"# the model: {model.note}",
        "MODEL_ARGS=(" + " ".join(shlex.quote(t) for t in configs.model_flags(recipe, model.name)) + ")",
        'if [[ $# -ge 1 && "$1" != -* ]]; then',
        '  TRAIN=("$1"); shift',
        "else",
        "  TRAIN=(" + " ".join(shlex.quote(t) for t in default) + ")",
        "fi",
    ]
    if recipe.device != "cpu":
        lines.append(f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{gpu_list(train)}}}"')
    if server:
        serve = " ".join(shlex.quote(t) for t in configs.vllm_serve_command(params, recipe, model.name))
        lines += [
            "# vLLM server mode: start the generation server on the other GPUs first, and wait until",
            "# `curl -sf http://localhost:8000/health/` answers:",
            f"#   CUDA_VISIBLE_DEVICES={gpu_list(server)} {serve} &",
        ]
    lines += LOCAL_DATA
    command = ['accelerate launch --config_file "$HERE/accelerate_config.yaml"']
    if with_ds:
        command.append('--deepspeed_config_file "$HERE/ds_config.json"')
    command.append('"${TRAIN[@]}" --config "$HERE/grpo_config.yaml" "${MODEL_ARGS[@]}" "${ARGS[@]}"')
    lines.append(" \\\n  ".join(command))
    return "\n".join(lines) + "\n"
