"""What a candidate means to ms-swift: the ``swift rlhf --rlhf_type grpo`` command line.

One translation serves the swift runner's trials and the exported swift.sh: :func:`swift_trial_argv`
is what a trial runs, and :func:`production_argv` is that same list minus the flags that only make
sense in a trial (its length, output folder, logging, the stand-in prompts and reward), so the
shipped command is the measured one.

Flag names follow the installed ms-swift (:class:`SwiftVersion`), read from the ms-swift source
tree's tags:

* GRPO arrived in 3.2; ``--vllm_mode`` (colocate | server), ``--vllm_tensor_parallel_size``,
  ``--generation_batch_size`` and ``--steps_per_generation`` (TRL's names) in 3.5.0. Before 3.5
  colocation was ``--num_infer_workers`` arithmetic and the parallel size ``--tensor_parallel_size``,
  a different model of the run: 3.5.0 is the oldest version autotune drives (:data:`OLDEST`).
* ``--sleep_level``, ``--offload_optimizer``, ``--offload_model`` and ``--move_model_batches``
  exist from 3.3. Level 2 (weights discarded too) reloads the weights on every wake-up only from
  3.12.0 ("fix grpo sleep_level 2 causes gibberish outputs"); before that only 0 and 1 are sound.
* 4.0 renamed ``--train_type`` to ``--tuner_type`` (4.0 still read the old name, 4.1 and later
  refuse it).
* bitsandbytes loading is ``--quant_method bnb --quant_bits 4|8`` (+ ``--bnb_4bit_*``) in 3.x and 4.x.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.configs.deepspeed import offload_of, uses_deepspeed, zero_stage_of
from autotune.configs.trl import (
    DEFAULT_VLLM_SERVER_PORT,
    effective,
    gpu_split,
    lora_adapter,
    vllm_max_model_length,
)
from autotune.recipe import Recipe


@dataclass(frozen=True, order=True)
class SwiftVersion:
    """An ms-swift release, for the flag names it understands."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> SwiftVersion | None:
        """``4.6.0``, ``3.12.6``, ``4.0.0.dev0``, ``3.1.1.post1`` -> a version; None when unreadable."""
        found = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
        if not found:
            return None
        return cls(int(found.group(1)), int(found.group(2)), int(found.group(3) or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def supported(self) -> bool:
        return self >= OLDEST

    @property
    def tuner_flag(self) -> str:
        """Full or LoRA training: ``--tuner_type`` from 4.0, ``--train_type`` before."""
        return "--tuner_type" if self.major >= 4 else "--train_type"

    @property
    def max_sleep_level(self) -> int:
        """The highest ``--sleep_level`` that trains correctly (2 from 3.12.0, else 1)."""
        return 2 if self >= SwiftVersion(3, 12, 0) else 1


#: The oldest ms-swift whose GRPO arguments autotune can write (``--vllm_mode`` and TRL's names).
OLDEST = SwiftVersion(3, 5, 0)
#: The version flags are written for when none is installed (the export on a machine without it):
#: the one autotune is tested with, which scripts/swift_env.sh installs.
TESTED = SwiftVersion(4, 6, 0)


# ms-swift's --deepspeed presets (swift/config/*.json in ms-swift >= 3.0; zero3_offload offloads both
# optimizer and parameters there; in 2.x it offloaded parameters only, so 2.x is not targeted).
SWIFT_PRESETS: dict[tuple[int, str], str] = {
    (1, "none"): "zero1",
    (2, "none"): "zero2",
    (2, "optimizer"): "zero2_offload",
    (3, "none"): "zero3",
    (3, "optimizer+params"): "zero3_offload",
}

#: Search parameters only ms-swift reads (search_spaces/swift.yaml): sent as its own flags.
#: ``deepspeed_config`` picks ms-swift's preset (``preset``) or autotune's measured JSON (``autotune``).
SWIFT_ONLY = frozenset(
    {"sleep_level", "offload_optimizer", "offload_model", "move_model_batches", "deepspeed_config"}
)
#: Parameters passed under their own name when a space has them (TRL's names, same in ms-swift).
SWIFT_PASSTHROUGH = (
    "use_liger_kernel",
    "steps_per_generation",
    "generation_batch_size",
    "ds3_gather_for_generation",
)

#: Flags that shape a trial rather than the training run: removed from the exported command.
TRIAL_ONLY = frozenset(
    {
        "--max_steps",
        "--output_dir",
        "--logging_steps",
        "--report_to",
        "--save_strategy",
        "--dataloader_num_workers",
        "--dataset_num_proc",
        "--logging_dir",
        "--add_version",
    }
)
#: The reward a trial uses when the user's is not known: a regex check, no network, no extra package.
STAND_IN_REWARD = "format"


def swift_deepspeed(params: dict[str, Any], recipe: Recipe) -> str | None:
    """ms-swift's ``--deepspeed`` preset for the stage/offload, or None when there is none.

    None also for no DeepSpeed at all; tell the two apart with :func:`uses_deepspeed`.
    """
    if not uses_deepspeed(params, recipe):
        return None
    return SWIFT_PRESETS.get((zero_stage_of(params) or 0, offload_of(params)))


def _flag(value: bool) -> str:
    return "true" if value else "false"


def sleep_level(params: dict[str, Any], version: SwiftVersion = TESTED) -> int:
    """ms-swift's ``--sleep_level``: the space's own knob, else TRL's sleep mode as the deepest
    level this version handles (TRL's ``vllm_enable_sleep_mode`` sleeps at level 2)."""
    if "sleep_level" in params:
        return int(params["sleep_level"])
    return version.max_sleep_level if params.get("vllm_enable_sleep_mode") else 0


def quantization_flags(recipe: Recipe) -> list[str]:
    """bitsandbytes loading as ``--quantization`` asks (NF4 with double quantization for 4bit,
    as QLoRA does; the compute dtype is the trial's dtype)."""
    if recipe.quantization == "4bit":
        return [
            "--quant_method",
            "bnb",
            "--quant_bits",
            "4",
            "--bnb_4bit_quant_type",
            "nf4",
            "--bnb_4bit_use_double_quant",
            "true",
            "--bnb_4bit_compute_dtype",
            "float32" if recipe.device == "cpu" else "bfloat16",
        ]
    if recipe.quantization == "8bit":
        return ["--quant_method", "bnb", "--quant_bits", "8"]
    return []


def swift_command(
    params: dict[str, Any],
    recipe: Recipe,
    model: str,
    *,
    ds_config_path: str = "ds_config.json",
    version: SwiftVersion | None = None,
    model_type: str | None = None,
    template: str | None = None,
    program: str = "swift",
) -> list[str]:
    """The ``swift rlhf --rlhf_type grpo`` argv for the configuration (no trial-only flags).

    Every tuned value is written, since ms-swift's defaults differ from TRL's. A stage/offload
    pair without a swift preset (e.g. ZeRO-3 with optimizer-only offload), or a space that asks
    for autotune's JSON (``deepspeed_config=autotune``), is passed as the path of our own DeepSpeed
    JSON, which ``--deepspeed`` also accepts. Dataset and reward functions are the user's to add.
    """
    version = version or TESTED
    eff = effective(params, recipe)
    cpu = recipe.device == "cpu"
    argv = [program, "rlhf", "--rlhf_type", "grpo", "--model", model]
    if model_type:
        argv += ["--model_type", model_type]
    if template:
        argv += ["--template", template]
    argv += [version.tuner_flag, "lora" if recipe.lora_rank else "full"]
    if recipe.lora_rank:  # the TRL trials' adapter; ms-swift's defaults are alpha 32, dropout 0.05
        lora = lora_adapter(int(recipe.lora_rank))
        argv += ["--lora_rank", str(lora["r"]), "--lora_alpha", str(lora["lora_alpha"])]
        argv += ["--target_modules", lora["target_modules"], "--lora_dropout", str(lora["lora_dropout"])]
    argv += quantization_flags(recipe)
    argv += [
        "--torch_dtype",
        "float32" if cpu else "bfloat16",
        "--per_device_train_batch_size",
        str(int(eff["per_device_train_batch_size"])),
        "--gradient_accumulation_steps",
        str(int(eff["gradient_accumulation_steps"])),
        "--num_generations",
        str(int(eff["num_generations"])),
        "--max_length",
        str(int(recipe.max_prompt_length)),
        "--max_completion_length",
        str(int(recipe.max_completion_length)),
        "--gradient_checkpointing",
        _flag(bool(eff["gradient_checkpointing"])),
        "--beta",
        str(float(recipe.beta)),
    ]
    if uses_deepspeed(params, recipe):
        preset = (
            swift_deepspeed(params, recipe) if params.get("deepspeed_config", "preset") == "preset" else None
        )
        argv += ["--deepspeed", preset or str(ds_config_path)]
    use_vllm = bool(eff["use_vllm"])
    argv += ["--use_vllm", _flag(use_vllm)]
    if use_vllm:
        mode = str(eff["vllm_mode"])
        argv += ["--vllm_mode", mode]
        if mode == "colocate":
            argv += [
                "--vllm_gpu_memory_utilization",
                str(float(eff["vllm_gpu_memory_utilization"])),
                "--vllm_tensor_parallel_size",
                str(int(eff["vllm_tensor_parallel_size"])),
                "--vllm_max_model_len",
                str(vllm_max_model_length(recipe)),
                "--sleep_level",
                str(sleep_level(params, version)),
            ]
            for name in ("offload_optimizer", "offload_model"):
                if name in params:
                    argv += [f"--{name}", _flag(bool(params[name]))]
        else:
            argv += ["--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(DEFAULT_VLLM_SERVER_PORT)]
        if int(params.get("move_model_batches") or 0) > 0:
            argv += ["--move_model_batches", str(int(params["move_model_batches"]))]
    for name in SWIFT_PASSTHROUGH:
        if name in params:
            value = params[name]
            argv += [f"--{name}", _flag(value) if isinstance(value, bool) else str(value)]
    return argv


@dataclass(frozen=True)
class TrialInputs:
    """What a trial adds to the configuration: where its model, prompts and output are."""

    program: str  # the swift script
    model: str  # a directory (a materialised card, the user's checkpoint) or a hub id
    model_type: str | None
    template: str | None
    dataset: str  # a JSON-lines file of prompts
    output_dir: str
    max_steps: int
    reward: str = STAND_IN_REWARD
    ds_config_path: str = "ds_config.json"
    # autotune's own prompts are exactly max_length tokens: the template's tokens are cut from the
    # left instead of the row being dropped (ms-swift 3.x GRPO deletes over-long rows by default)
    truncate_left: bool = False


def swift_trial_argv(
    params: dict[str, Any], recipe: Recipe, trial: TrialInputs, version: SwiftVersion | None = None
) -> list[str]:
    """The argv a trial runs: the configuration, the user's ``--swift-args``, then the trial's own
    flags (last, so a trial is always as long as autotune needs whatever the user passed)."""
    argv = swift_command(
        params,
        recipe,
        trial.model,
        ds_config_path=trial.ds_config_path,
        version=version,
        model_type=trial.model_type,
        template=trial.template,
        program=trial.program,
    )
    argv += shlex.split(recipe.swift_args or "")
    argv += ["--dataset", trial.dataset, "--reward_funcs", trial.reward]
    if trial.truncate_left:
        argv += ["--truncation_strategy", "left"]
    argv += [
        "--max_steps",
        str(int(trial.max_steps)),
        "--logging_steps",
        "1",
        "--output_dir",
        trial.output_dir,
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--dataloader_num_workers",
        "0",
        "--dataset_num_proc",
        "1",
    ]
    return argv


def production_argv(
    trial_argv: list[str],
    *,
    model: str | None = None,
    keep_dataset: bool = False,
    keep_template: bool = True,
    ds_config: str | None = None,
) -> list[str]:
    """The measured command minus what only a trial needs.

    Drops :data:`TRIAL_ONLY` flags with their values, the stand-in prompts and reward (unless the
    prompts are the user's own ``--dataset``), and the template when the model becomes a hub id
    (a materialised card's template only matched autotune's offline tokenizer). The program
    becomes plain ``swift``; ``model`` replaces the trial's model path; ``ds_config`` replaces a
    DeepSpeed JSON path.
    """
    drop = set(TRIAL_ONLY) | {"--reward_funcs"}
    if not keep_dataset:
        drop |= {"--dataset", "--truncation_strategy"}
    if not keep_template:
        drop.add("--template")
    out = ["swift"]
    i = 1
    while i < len(trial_argv):
        token = trial_argv[i]
        has_value = i + 1 < len(trial_argv) and not trial_argv[i + 1].startswith("--")
        if token in drop:
            i += 2 if has_value else 1
            continue
        if has_value and token == "--model" and model is not None:
            out += [token, model]
        elif (
            has_value
            and token == "--deepspeed"
            and ds_config is not None
            and trial_argv[i + 1].endswith(".json")
        ):
            out += [token, ds_config]
        else:
            out += trial_argv[i : i + (2 if has_value else 1)]
        i += 2 if has_value else 1
    return out


def swift_rollout_command(params: dict[str, Any], recipe: Recipe, model: str) -> list[str]:
    """``swift rollout`` (ms-swift's vLLM server) for server mode."""
    eff = effective(params, recipe)
    return [
        "swift",
        "rollout",
        "--model",
        model,
        "--vllm_tensor_parallel_size",
        str(int(eff["vllm_tensor_parallel_size"])),
        "--vllm_max_model_len",
        str(vllm_max_model_length(recipe)),
        "--port",
        str(DEFAULT_VLLM_SERVER_PORT),
    ]


def swift_env(params: dict[str, Any], recipe: Recipe) -> dict[str, str]:
    """NPROC_PER_NODE (training processes) and the training GPUs for swift.sh."""
    train, _ = gpu_split(params, recipe)
    return {"NPROC_PER_NODE": str(len(train)), "CUDA_VISIBLE_DEVICES": ",".join(map(str, train))}


def swift_space_path() -> Path:
    """The shipped ms-swift space (``autotune/spaces`` links to the top-level ``search_spaces``)."""
    return Path(__file__).resolve().parents[1] / "spaces" / "swift.yaml"
