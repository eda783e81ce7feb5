"""The command runner: any trainer, driven through a command template.

``--command "swift rlhf --rlhf_type grpo --per_device_train_batch_size {per_device_train_batch_size}"``
is split like a shell would split it, once, up front; each candidate's values are then put into
the argv elements as plain strings. No shell ever sees them, so no value can inject a command.
Only the parameters the template names are searched; the rest keep their defaults, because
changing a knob the trainer never receives would measure the same run twice.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import string
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.trial.launch import LaunchSpec
from autotune.runners.base import Runner

# placeholders that are not search parameters
EXTRA_FIELDS = (
    "model", "gpus", "num_processes", "trial_dir", "metrics_file", "deepspeed_config",
    "max_prompt_length", "max_completion_length", "max_length", "global_batch", "beta", "lora_rank",
)


def template_fields(template: str) -> tuple[list[str], list[set[str]]]:
    """Split a template into argv tokens and the placeholder names of each token."""
    try:
        tokens = shlex.split(template)
    except ValueError as exc:
        raise UsageError(f"--command cannot be split like a shell line: {exc}")
    if not tokens:
        raise UsageError("--command is empty: give the trainer's command line")
    names: list[set[str]] = []
    for token in tokens:
        try:
            parsed = list(string.Formatter().parse(token))
        except ValueError as exc:
            raise UsageError(f"--command token {token!r}: {exc} (write a literal brace as {{{{ or }}}})")
        found = set()
        for _, field_name, spec, conv in parsed:
            if field_name is None:
                continue
            if not field_name.isidentifier():
                raise UsageError(f"--command placeholder {{{field_name}}} is not a plain name")
            found.add(field_name)
        names.append(found)
    return tokens, names


def format_value(value: Any) -> str:
    """How a value appears on a command line: true/false for booleans, shortest float text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(round(value, 6))
    return str(value)


class CommandRunner(Runner):
    name = "command"

    def __init__(self, context) -> None:
        super().__init__(context)
        template = self.recipe.command
        if not template:
            raise UsageError("--runner command needs --command 'TEMPLATE' with {placeholders}")
        self.tokens, self.fields = template_fields(template)
        self.used = set().union(*self.fields)

    def check(self) -> None:
        program = self.tokens[0]
        if self.fields[0]:
            raise UsageError("--command must start with a program name, not a placeholder")
        if not (shutil.which(program) or (os.sep in program and os.access(program, os.X_OK))):
            raise UsageError(f"--command program '{program}' was not found on PATH: install it or give its full path")
        known = set(self.context.space.params) | set(EXTRA_FIELDS)
        for name in sorted(self.used):
            if name not in known:
                raise UsageError(
                    f"--command placeholder {{{name}}} names nothing: use a parameter "
                    f"({', '.join(self.context.space.params)}) or one of {', '.join(EXTRA_FIELDS)}"
                )

    def searched(self) -> set[str]:
        names = {n for n in self.used if n in self.context.space.params}
        if "deepspeed_config" in self.used:
            names |= {"zero_stage", "offload"} & set(self.context.space.params)
        if self.recipe.global_batch and "per_device_train_batch_size" in names:
            names.add("gradient_accumulation_steps")
        return names

    def prepare(self, params: dict[str, Any], trial_dir: Path, number: int) -> LaunchSpec:
        recipe = self.recipe
        trial_dir.mkdir(parents=True, exist_ok=True)
        values: dict[str, Any] = {
            **params,
            "model": self.context.model.path or recipe.model,
            "gpus": recipe.gpus,
            "num_processes": recipe.dp_gpus(params),
            "trial_dir": trial_dir,
            "metrics_file": trial_dir / "metrics.jsonl",
            "max_prompt_length": recipe.max_prompt_length,
            "max_completion_length": recipe.max_completion_length,
            "max_length": recipe.max_prompt_length,
            "global_batch": recipe.global_batch or recipe.completions_per_step(params),
            "beta": recipe.beta,
            "lora_rank": recipe.lora_rank or 0,
        }
        if "deepspeed_config" in self.used:
            from autotune.configs import deepspeed_config

            path = trial_dir / "ds_config.json"
            path.write_text(json.dumps(deepspeed_config(params, recipe), indent=2))
            values["deepspeed_config"] = path
        argv = [token.format(**{k: format_value(v) for k, v in values.items()}) for token in self.tokens]
        env = self.base_env(trial_dir)
        env["NPROC_PER_NODE"] = str(recipe.dp_gpus(params))
        return LaunchSpec(argv=argv, env=env, trial_dir=trial_dir, cwd=Path(recipe.workdir or Path.cwd()),
                          memory_limit_gib=recipe.memory_limit_gib)
