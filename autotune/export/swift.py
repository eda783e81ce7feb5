"""ms-swift's file: swift.sh, the same configuration as ``swift rlhf --rlhf_type grpo``."""

from __future__ import annotations

import shlex
from typing import Any

from autotune import configs
from autotune.export.trl import gpu_list
from autotune.recipe import Recipe
from autotune.study.record import TrialRow


_DS_SENTINEL = "\x00ds_config\x00"


def swift_sh(params: dict[str, Any], recipe: Recipe, best: TrialRow) -> str:
    """swift.sh: the same configuration for ms-swift, shell-quoted token by token."""
    argv = configs.swift_command(params, recipe, recipe.model, ds_config_path=_DS_SENTINEL)
    env = configs.swift_env(params, recipe)
    _, server = configs.gpu_split(params, recipe)
    quoted = ['"$HERE/ds_config.json"' if token == _DS_SENTINEL else shlex.quote(token) for token in argv]
    lines = [
        "#!/usr/bin/env bash",
        f"# GRPO with ms-swift (4.x flag names), tuned by autotune (trial {best.number}).",
        "# usage: swift.sh --dataset D --reward_funcs R [more swift rlhf flags...]",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f"export NPROC_PER_NODE={shlex.quote(env['NPROC_PER_NODE'])}",
    ]
    if recipe.device != "cpu":
        lines.append(f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{env["CUDA_VISIBLE_DEVICES"]}}}"')
    if _DS_SENTINEL in argv:
        lines.append("# no ms-swift --deepspeed preset has this ZeRO stage/offload: "
                     "the JSON beside this script is used")
    if server:
        rollout = " ".join(shlex.quote(t) for t in configs.swift_rollout_command(params, recipe, recipe.model))
        lines += ["# vLLM server mode: start the rollout server on the other GPUs first:",
                  f"#   CUDA_VISIBLE_DEVICES={gpu_list(server)} {rollout} &"]
    body = [" ".join(quoted[:2])]   # "swift rlhf"
    i = 2
    while i < len(quoted):   # one flag and its value per line, for readability
        if i + 1 < len(quoted) and quoted[i].startswith("--") and not quoted[i + 1].startswith("--"):
            body.append(f"{quoted[i]} {quoted[i + 1]}")
            i += 2
        else:
            body.append(quoted[i])
            i += 1
    lines.append("exec " + " \\\n  ".join(body + ['"$@"']))
    return "\n".join(lines) + "\n"
