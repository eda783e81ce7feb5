"""ms-swift's file: swift.sh, the same configuration as ``swift rlhf --rlhf_type grpo``.

With ``--runner swift`` it is the command the trials ran (:func:`export_argv`
rebuilds it with the same translation), minus the trial-only flags: no step limit, output folder,
logging or stand-in prompts and reward; the model named by its hub id, or by the local path the
trials used when the card has none. With the other runners it is the same configuration written
for ms-swift, with the flag names of the installed ms-swift (4.6.0's when none is installed).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from autotune import configs
from autotune.configs.swift import TESTED, SwiftVersion
from autotune.configs.swift_install import find_swift, swift_python, swift_version
from autotune.configs.swift_model import (
    MODEL_TYPES,
    OUTPUT_DIR,
    PROMPTS_FILE,
    dataset_arg,
    swift_model,
    trial_inputs,
)
from autotune.errors import UsageError
from autotune.export.model import export_model
from autotune.export.trl import gpu_list
from autotune.models import ModelSpec, resolve_model
from autotune.recipe import Recipe
from autotune.study.record import TrialRow
from autotune.worker.materialise import model_dir_for

_DS_SENTINEL = "\x00ds_config\x00.json"


def export_argv(
    params: dict[str, Any], recipe: Recipe, model: ModelSpec, ds_config: str = "ds_config.json"
) -> tuple[list[str], SwiftVersion, Path | None]:
    """swift.sh's command: what a trial of ``params`` runs (the swift runner's ``prepare``), minus
    the trial-only flags, for the ms-swift this machine has (or :data:`TESTED`, with no program)."""
    program: Path | None
    try:
        program = find_swift(recipe)
        version = swift_version(swift_python(program))
    except UsageError:
        program, version = None, TESTED
    plan = swift_model(model, recipe)
    trial_model = (
        str(model_dir_for(model.name, model.config, recipe.device))
        if plan.shape_only
        else plan.export_model or ""
    )
    inputs = trial_inputs(
        recipe,
        plan,
        program="swift",
        model=trial_model,
        dataset=dataset_arg(recipe) or PROMPTS_FILE,
        output_dir=OUTPUT_DIR,
        max_steps=1,
        ds_config_path=ds_config,
    )
    argv = configs.swift_trial_argv(params, recipe, inputs, version)
    return (
        configs.production_argv(
            argv,
            model=plan.export_model or trial_model,
            keep_dataset=bool(recipe.dataset),
            keep_template=plan.export_template,
        ),
        version,
        program,
    )


def _argv(params: dict[str, Any], recipe: Recipe) -> tuple[list[str], str, Path | None]:
    """The command, the version its flag names are for, and the swift program that measured it."""
    try:
        model = resolve_model(recipe.model)
    except UsageError:
        model = None
    if model is not None and recipe.runner == "swift":
        argv, version, program = export_argv(params, recipe, model, ds_config=_DS_SENTINEL)
        return argv, str(version), program
    named = export_model(recipe)  # a hub id or a local folder, never a bare card name
    template = "qwen" if named.rehearsal else None  # the materialised tokenizer's chat markers
    model_type = MODEL_TYPES.get(model.model_type) if named.rehearsal and model is not None else None
    argv = configs.swift_command(
        params, recipe, named.name, ds_config_path=_DS_SENTINEL, model_type=model_type, template=template
    )
    return argv, str(configs.SwiftVersion(4, 6, 0)), None


def swift_sh(params: dict[str, Any], recipe: Recipe, best: TrialRow) -> str:
    """swift.sh: the same configuration for ms-swift, shell-quoted token by token."""
    argv, version, program = _argv(params, recipe)
    env = configs.swift_env(params, recipe)
    _, server = configs.gpu_split(params, recipe)
    quoted = ['"$HERE/ds_config.json"' if token == _DS_SENTINEL else shlex.quote(token) for token in argv]
    measured = (
        f"the command trial {best.number} ran, less its trial-only flags"
        if recipe.runner == "swift"
        else f"the configuration of trial {best.number}"
    )
    lines = [
        "#!/usr/bin/env bash",
        f"# GRPO with ms-swift ({version} flag names), tuned by autotune: {measured}.",
        "# usage: swift.sh --dataset D --reward_funcs R [more swift rlhf flags...]"
        if not (recipe.runner == "swift" and recipe.dataset)
        else "# usage: swift.sh --reward_funcs R [more swift rlhf flags...]",
    ]
    if program is not None:
        lines.append(
            f"# measured with ms-swift {version} at {program}: put {program.parent} on PATH, "
            "or make it with bash scripts/swift_env.sh"
        )
    lines += [
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    ]
    if int(env["NPROC_PER_NODE"]) > 1:  # as the trials: set at all, ms-swift starts torch.distributed
        lines.append(f"export NPROC_PER_NODE={shlex.quote(env['NPROC_PER_NODE'])}")
    if recipe.device != "cpu":
        lines.append(
            f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{env["CUDA_VISIBLE_DEVICES"]}}}"'
        )
    if _DS_SENTINEL in argv:
        lines.append(
            "# the DeepSpeed JSON beside this script is used (the one the trials measured, or no "
            "ms-swift --deepspeed preset has this ZeRO stage/offload)"
        )
    if server:
        model_arg = argv[argv.index("--model") + 1] if "--model" in argv else recipe.model
        rollout = " ".join(shlex.quote(t) for t in configs.swift_rollout_command(params, recipe, model_arg))
        lines += [
            "# vLLM server mode: start the rollout server on the other GPUs first:",
            f"#   CUDA_VISIBLE_DEVICES={gpu_list(server)} {rollout} &",
        ]
    body = [" ".join(quoted[:2])]  # "swift rlhf"
    i = 2
    while i < len(quoted):  # one flag and its value per line, for readability
        if i + 1 < len(quoted) and quoted[i].startswith("--") and not quoted[i + 1].startswith("--"):
            body.append(f"{quoted[i]} {quoted[i + 1]}")
            i += 2
        else:
            body.append(quoted[i])
            i += 1
    lines.append("exec " + " \\\n  ".join(body + ['"$@"']))
    return "\n".join(lines) + "\n"
