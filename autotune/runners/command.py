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
import shutil
from pathlib import Path
from typing import Any

from autotune.configs.command import (
    DEFAULT_MASTER_PORT,
    EXTRA_FIELDS,
    check_specs,
    fill,
    placeholder_values,
    template_fields,
)
from autotune.errors import UsageError
from autotune.runners.base import Runner, free_port
from autotune.trial.launch import LaunchSpec


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
            raise UsageError(
                f"--command program '{program}' was not found on PATH: install it or give its full path"
            )
        space = self.context.space
        known = set(space.params) | set(EXTRA_FIELDS)
        for name in sorted(self.used):
            if name not in known:
                raise UsageError(
                    f"--command placeholder {{{name}}} names nothing: "
                    f"use a parameter of the space {space.path} "
                    f"({', '.join(space.params)}) or one of {', '.join(EXTRA_FIELDS)}"
                )
        batch = space.batch
        if (
            self.recipe.global_batch
            and batch is not None
            and batch.micro_batch in self.used
            and not {"global_batch", batch.accumulation} & self.used
        ):
            raise UsageError(
                f"--global-batch {self.recipe.global_batch}: "
                "the template passes neither {global_batch} nor "
                f"{{{batch.accumulation or 'an accumulation parameter'}}}, "
                "so the trainer would never see it: add one"
            )
        samples: dict[str, list[Any]] = {
            name: [*p.grid_values(), p.default] for name, p in space.params.items()
        }
        samples.update(
            {
                name: [value]
                for name, value in self.values(space.defaults(), Path("trial")).items()
                if name not in space.params
            }
        )
        check_specs(self.tokens, samples)

    def searched(self) -> set[str]:
        space = self.context.space
        names = {n for n in self.used if n in space.params}
        if "deepspeed_config" in self.used:
            names |= {"zero_stage", "offload"} & set(space.params)
        batch = space.batch
        if self.recipe.global_batch and batch is not None and batch.accumulation:
            if batch.declared:
                names.discard(batch.accumulation)  # derived from --global-batch, never sampled
            elif batch.micro_batch in names:
                names.add(batch.accumulation)
        return names

    def values(
        self,
        params: dict[str, Any],
        trial_dir: Path,
        master_port: int = DEFAULT_MASTER_PORT,
        steps_needed: int | None = None,
    ) -> dict[str, Any]:
        """Every placeholder's value; ``{max_steps}`` is what run() says the trial needs."""
        recipe = self.recipe
        return placeholder_values(
            recipe,
            params,
            trial_dir,
            model=str(self.context.model.path or recipe.model),
            batch=self.context.space.batch,
            max_steps=steps_needed or recipe.warmup_steps + recipe.measure_steps,
            defaults=self.context.space.defaults(),
            master_port=master_port,
        )

    def prepare(
        self, params: dict[str, Any], trial_dir: Path, number: int, steps_needed: int | None = None
    ) -> LaunchSpec:
        recipe = self.recipe
        trial_dir.mkdir(parents=True, exist_ok=True)
        # a port of this trial's own, in MASTER_PORT and {master_port}: torchrun, accelerate and
        # ms-swift otherwise all rendezvous on 29500, and parallel multi-process trials would collide
        port = free_port()
        values = self.values(params, trial_dir, master_port=port, steps_needed=steps_needed)
        if "deepspeed_config" in self.used:
            from autotune.configs import deepspeed_config

            values["deepspeed_config"].write_text(json.dumps(deepspeed_config(params, recipe), indent=2))
        argv = fill(self.tokens, values)
        env = self.base_env(trial_dir)
        env["NPROC_PER_NODE"] = str(recipe.dp_gpus(params))
        env["MASTER_PORT"] = str(port)
        return LaunchSpec(
            argv=argv,
            env=env,
            trial_dir=trial_dir,
            cwd=Path(recipe.workdir or Path.cwd()),
            memory_limit_gib=recipe.memory_limit_gib,
        )
