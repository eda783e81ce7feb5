"""The ms-swift runner: each candidate becomes a real ``swift rlhf --rlhf_type grpo`` run.

ms-swift lives in an environment of its own (4.6.0 pins trl 0.29.1, which autotune's TRL worker
does not use; ``bash scripts/swift_env.sh`` makes it). autotune only runs its ``swift`` script as a
subprocess and reads the step lines it prints (:mod:`autotune.trial.logparse`), so the two never
share an interpreter. Which ``swift`` and which version: :mod:`autotune.configs.swift_install`
(the flag names follow the version, :class:`autotune.configs.swift.SwiftVersion`).

What a trial passes besides the candidate (:func:`autotune.configs.swift.swift_trial_argv`):

* the model: a checkpoint with weights is passed by path; a shape-only card is materialised once
  as a model directory with random weights and an offline tokenizer
  (:mod:`autotune.worker.materialise`), passed with ``--model_type`` and ``--template qwen``;
* the prompts: ``Recipe.dataset`` as given, else worst-case prompts of exactly
  ``max_prompt_length`` tokens written as chat JSON lines (and ``--truncation_strategy left``, so
  the template's own tokens cut the prompt to ``--max_length`` instead of dropping the row);
* the reward ``format`` (a regex, no network, no extra package);
* ``--max_steps`` covering warm-up and measured steps (confirmation runs included), one log line
  per step, no checkpoints, no reporting.

Files in the trial folder: ``swift_argv.json`` (the argv, the ms-swift version and the
materialised model, beside command.txt), ``prompts.jsonl``, ``ds_config.json`` when the
configuration uses autotune's DeepSpeed JSON, and ``swift_output/`` (ms-swift's output folder).
"""

from __future__ import annotations

import json
import os
import shlex
import threading
from pathlib import Path
from typing import Any

from autotune import configs as lc
from autotune.candidate.batch import completions_per_step
from autotune.configs.swift import OLDEST, TESTED, SwiftVersion
from autotune.configs.swift_install import find_swift, swift_python, swift_version
from autotune.configs.swift_model import (
    OUTPUT_DIR,
    PROMPTS_FILE,
    SwiftModel,
    dataset_arg,
    swift_model,
    trial_inputs,
)
from autotune.errors import UsageError
from autotune.runners.base import Rule, Runner, free_port, max_steps
from autotune.runners.swift_env import refuse_missing, restrict
from autotune.trial.launch import LaunchSpec

ARGV_FILE = "swift_argv.json"
DEEPSPEED_FILE = "ds_config.json"


class SwiftRunner(Runner):
    """Trials that run ms-swift's GRPO on the recipe's model, on GPUs or (rehearsal) on CPU."""

    name = "swift"
    #: Parallel trials' slot threads share one runner per slot; the first to need the shape-only
    #: model builds it and the rest wait for it here instead of each writing a copy at once (the
    #: on-disk done marker and lock in :mod:`autotune.worker.materialise` cover other processes).
    _materialising = threading.Lock()

    def __init__(self, context) -> None:
        super().__init__(context)
        self.program: Path | None = None
        self.python: str | None = None
        self.version: SwiftVersion | None = None

    # -- up front -------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail before the first trial when no trial could run: swift, its version, the inputs."""
        recipe = self.recipe
        self.check_inputs()
        if recipe.device not in ("cuda", "cpu"):
            raise UsageError(f"--device {recipe.device!r}: use cuda or cpu")
        if recipe.device == "cuda" and recipe.memory_limit_gib:
            raise UsageError(
                "--memory-limit caps a trial's address space (RLIMIT_AS), which CUDA cannot "
                "start under: use it with --device cpu"
            )
        try:
            shlex.split(recipe.swift_args or "")
        except ValueError as exc:
            raise UsageError(f"--swift-args cannot be split like a shell line: {exc}") from None
        if (
            recipe.dataset
            and _looks_local(recipe.dataset)
            and dataset_arg(recipe) == recipe.dataset
            and not Path(recipe.dataset).expanduser().exists()
        ):
            raise UsageError(f"--dataset {recipe.dataset}: no such file")
        self.program = find_swift(recipe)
        self.python = swift_python(self.program)
        self.version = swift_version(self.python)
        if not self.version.supported:
            raise UsageError(
                f"ms-swift {self.version} at {self.program} is too old: autotune needs ms-swift >= "
                f"{OLDEST} (GRPO with --vllm_mode); upgrade it, e.g. bash scripts/swift_env.sh"
            )
        refuse_missing(self.python, recipe.quantization)

    def check_inputs(self) -> None:
        """Refuse what a swift trial would not measure: its prompts are text only (worst-case chat
        rows or the user's dataset as given), so image tokens would make the planner count images
        and vision activations that no trial ever carries."""
        if int(self.recipe.image_tokens or 0) > 0:
            raise UsageError(
                f"--image-tokens {self.recipe.image_tokens} with --runner swift: the swift runner runs "
                "text-only trials (no images); leave --image-tokens out, or use --runner trl"
            )

    def rules(self) -> list[Rule]:
        """Candidates this ms-swift or machine cannot run, each with a one-line reason."""
        cpu = self.recipe.device == "cpu"
        version = self.version or TESTED

        def vllm_rule(params: dict[str, Any]) -> str | None:
            if not params.get("use_vllm"):
                return None
            if cpu:
                return "use_vllm: vLLM needs a GPU (--device cpu); pin --set use_vllm=false"
            if params.get("vllm_mode") == "server":
                return "vllm_mode=server: the swift runner starts no swift rollout server; search colocate"
            return None

        def sleep_rule(params: dict[str, Any]) -> str | None:
            level = int(params.get("sleep_level") or 0)
            if level > version.max_sleep_level:
                return (
                    f"sleep_level={level} needs ms-swift >= 3.12.0 (older releases do not reload the "
                    f"weights after a level-2 sleep); this is {version}"
                )
            return None

        def deepspeed_rule(params: dict[str, Any]) -> str | None:
            if params.get("deepspeed_config", "preset") != "autotune":
                return None
            if not lc.uses_deepspeed(params, self.recipe):
                return "deepspeed_config=autotune without ZeRO: the same run as deepspeed_config=preset"
            if lc.swift_deepspeed(params, self.recipe) is None:
                return (
                    "deepspeed_config=autotune: ms-swift has no preset for this stage/offload, so preset "
                    "already uses autotune's JSON"
                )
            return None

        return [vllm_rule, sleep_rule, deepspeed_rule]

    def forced(self) -> dict[str, Any]:
        """CPU trials run without vLLM; what ms-swift's own environment lacks is not searched."""
        _, python, _ = self._ready()
        cpu = self.recipe.device == "cpu"
        out = restrict(python, cpu=cpu, processes=int(self.recipe.gpus))
        return {**out, "use_vllm": False} if cpu else out

    # -- one trial ------------------------------------------------------------------------------
    def _ready(self) -> tuple[Path, str, SwiftVersion]:
        if self.program is None or self.python is None or self.version is None:
            self.check()
        assert self.program is not None and self.python is not None and self.version is not None
        return self.program, self.python, self.version

    def model_dir(self) -> tuple[SwiftModel, str]:
        """The model as trials pass it: a path with weights, or the materialised card (built once)."""
        program, python, _ = self._ready()
        plan = swift_model(self.context.model, self.recipe)
        model = self.context.model
        if not plan.shape_only:
            return plan, str(model.path.resolve()) if model.path else self.recipe.model
        from autotune.worker.materialise import ensure_model

        try:
            with SwiftRunner._materialising:
                return plan, str(ensure_model(python, model.name, model.config, self.recipe.device))
        except RuntimeError as exc:
            raise UsageError(f"cannot materialise model {model.name} for ms-swift: {exc}") from None

    def prompts(self, params: dict[str, Any], trial_dir: Path, model_dir: str, steps: int) -> str:
        """The prompts file of a trial: the user's ``--dataset``, or worst-case chat rows."""
        given = dataset_arg(self.recipe)
        if given:
            return given
        from autotune.worker.data import prompts_needed
        from autotune.worker.materialise import write_prompts

        eff = lc.effective(params, self.recipe)
        rows = 2 * prompts_needed(completions_per_step(eff, self.recipe), int(eff["num_generations"]), steps)
        # the prompt text depends on the tokenizer and length only: made once per study, then repeated
        length = int(self.recipe.max_prompt_length)
        one = trial_dir.parent.parent / "swift" / f"prompt-{length}.jsonl"
        if not one.is_file():
            try:
                write_prompts(self._ready()[1], Path(model_dir), length, 1, one)
            except RuntimeError as exc:
                raise UsageError(
                    f"cannot write the trial prompts with {model_dir}'s tokenizer: {exc}"
                ) from None
        row = one.read_text(encoding="utf-8").splitlines()[0]
        path = trial_dir / PROMPTS_FILE
        path.write_text((row + "\n") * rows, encoding="utf-8")
        return str(path.resolve())

    def prepare(
        self, params: dict[str, Any], trial_dir: Path, number: int, steps_needed: int | None = None
    ) -> LaunchSpec:
        recipe = self.recipe
        program, _, version = self._ready()
        trial_dir = Path(trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        plan, model_dir = self.model_dir()
        steps = max_steps(recipe, steps_needed)
        dataset = self.prompts(params, trial_dir, model_dir, steps)
        ds_path = trial_dir / DEEPSPEED_FILE
        if lc.uses_deepspeed(params, recipe):
            ds = lc.deepspeed_config(params, recipe)
            if ds is not None:
                ds_path.write_text(json.dumps(ds, indent=2), encoding="utf-8")
        inputs = trial_inputs(
            recipe,
            plan,
            program=str(program),
            model=model_dir,
            dataset=dataset,
            output_dir=str((trial_dir / OUTPUT_DIR).resolve()),
            max_steps=steps,
            ds_config_path=str(ds_path.resolve()),
        )
        argv = lc.swift_trial_argv(params, recipe, inputs, version)
        (trial_dir / ARGV_FILE).write_text(
            json.dumps(
                {
                    "argv": argv,
                    "ms_swift": str(version),
                    "model_dir": model_dir,
                    "shape_only": plan.shape_only,
                },
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )

        env = self.base_env(trial_dir)
        processes = recipe.dp_gpus(params)
        if processes > 1:  # set at all, it makes swift launch through torch.distributed.run
            env["NPROC_PER_NODE"] = str(processes)
            # ms-swift passes --master_port only when MASTER_PORT is set, else torch's 29500: two
            # parallel multi-process trials would both bind it and one would die of EADDRINUSE
            env["MASTER_PORT"] = str(free_port())
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if recipe.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["OMP_NUM_THREADS"] = str(max(1, min(4, (os.cpu_count() or 1) // max(processes, 1))))
            # glibc's per-thread arenas reserve address space, which RLIMIT_AS (--memory-limit) counts
            env.setdefault("MALLOC_ARENA_MAX", "2")
        return LaunchSpec(
            argv=argv, env=env, trial_dir=trial_dir, cwd=trial_dir, memory_limit_gib=recipe.memory_limit_gib
        )


def _looks_local(text: str) -> bool:
    return text.startswith((".", "/", "~")) or text.endswith((".jsonl", ".json", ".csv"))
