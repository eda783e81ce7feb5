"""What a candidate means to TRL: GRPOConfig keyword arguments and the vLLM server command.

The trial runners and the export both build their files from this package, so the production
run ships exactly what the search measured. Missing parameters take TRL's defaults, written out
explicitly (``TRL_DEFAULTS``): a later TRL release that changes a default cannot silently change
the shipped run, and ms-swift, whose defaults differ from TRL's (e.g. vLLM memory 0.9, beta 0.04),
is given the same numbers.

Checked in the installed packages (trl 1.16, transformers 5): GRPOConfig has no
``max_prompt_length`` in TRL 1.x (TypeError), so the prompt length is only used for vLLM's
``vllm_max_model_length`` here and for ms-swift's ``--max_length``.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
from typing import Any

from autotune.candidate.batch import accumulation_for
from autotune.candidate.defaults import TRL_DEFAULTS
from autotune.pyparse import parse
from autotune.recipe import Recipe

# Parameters a search space may add that are GRPOConfig fields and are passed through unchanged
# (all move memory or speed). Anything else unknown to TRL is dropped from the TRL config.
TRL_PASSTHROUGH = frozenset(
    {
        "use_liger_kernel",
        "generation_batch_size",
        "steps_per_generation",
        "torch_empty_cache_steps",
        "ds3_gather_for_generation",
        "vllm_model_impl",
        "cast_lm_head_to_fp32",
        "optim",
        "num_iterations",
        "torch_compile",
    }
)


# Parameters consumed by DeepSpeed / the launcher rather than TRL.
LAUNCH_ONLY = frozenset({"zero_stage", "offload"})

DEFAULT_VLLM_SERVER_PORT = 8000


def effective(params: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """The params with TRL defaults filled in and accumulation derived from ``global_batch``.

    Accumulation is derived only when it is missing (trial params already carry the derived value);
    a global batch that does not divide is left to the constraint check, not guessed here.
    """
    out = {**TRL_DEFAULTS, **params}
    if "gradient_accumulation_steps" not in params and recipe.global_batch:
        per_step = int(out["per_device_train_batch_size"]) * max(recipe.dp_gpus(out), 1)
        steps = accumulation_for(recipe.global_batch, per_step)
        if steps is not None:
            out["gradient_accumulation_steps"] = steps
    return out


def gpu_split(params: dict[str, Any], recipe: Recipe) -> tuple[list[int], list[int]]:
    """GPU indices for training and for a separate vLLM server (empty unless server mode).

    Training takes the first ``dp_gpus`` devices and the server the rest, as TRL's and ms-swift's
    examples do.
    """
    dp = recipe.dp_gpus(params)
    train = list(range(dp))
    server = list(range(dp, recipe.gpus)) if is_vllm_server(params) else []
    return train, server


def is_vllm_server(params: dict[str, Any]) -> bool:
    return bool(params.get("use_vllm")) and params.get("vllm_mode", "colocate") == "server"


def vllm_max_model_length(recipe: Recipe) -> int:
    """Prompt (with its image tokens) + completion: without it vLLM sizes its KV cache for the
    model's full context, and a vision-language prompt longer than it is refused."""
    images = int(recipe.image_tokens or 0) * int(recipe.images_per_prompt or 0)
    return int(recipe.max_prompt_length) + images + int(recipe.max_completion_length)


def quantization_config(recipe: Recipe) -> dict[str, Any] | None:
    """``--quantization`` as transformers' ``BitsAndBytesConfig`` fields (a plain dict, which
    ``from_pretrained`` and TRL's ``model_init_kwargs`` accept as they are).

    4bit is the QLoRA recipe: NF4 codes, double quantization, bf16 compute (float32 on CPU, where
    the trial runs in float32), and the packed codes stored in that dtype, which DeepSpeed ZeRO-3
    needs to shard them with the rest (peft's docs/source/accelerate/deepspeed.md, "Use PEFT QLoRA
    and DeepSpeed with ZeRO3"; the bytes are the same). A GPTQ/AWQ checkpoint needs nothing here:
    transformers reads its own ``quantization_config`` from config.json.
    """
    compute = "float32" if recipe.device == "cpu" else "bfloat16"
    if recipe.quantization == "4bit":
        return {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": compute,
            "bnb_4bit_quant_storage": compute,
        }
    if recipe.quantization == "8bit":
        return {"quant_method": "bitsandbytes", "load_in_8bit": True}
    return None


def model_init_kwargs(recipe: Recipe) -> dict[str, Any]:
    """``GRPOConfig.model_init_kwargs`` for a production run that loads the model by path.

    The trials ran the policy in bf16 on GPUs; TRL 1.16 loads a path in float32 unless told, which
    doubles plain training's model states. ``--quantization`` adds its BitsAndBytesConfig.
    """
    kwargs: dict[str, Any] = {} if recipe.device == "cpu" else {"dtype": "bfloat16"}
    quant = quantization_config(recipe)
    if quant:
        kwargs["quantization_config"] = quant
    return kwargs


#: The adapter a ``--lora-rank`` trial trains: every linear layer, alpha twice the rank, no dropout
#: (peft's LoraConfig default; TRL's ModelConfig defaults to 0.05 and ms-swift to 0.05 with alpha 32,
#: so both are written out).
LORA_TARGET_MODULES = "all-linear"


def lora_adapter(rank: int) -> dict[str, Any]:
    """The LoraConfig fields of a trial of this rank: the worker builds it, the exports write it."""
    return {
        "r": int(rank),
        "lora_alpha": 2 * int(rank),
        "target_modules": LORA_TARGET_MODULES,
        "lora_dropout": 0.0,
    }


def model_flags(recipe: Recipe, model: str) -> list[str]:
    """``trl.ModelConfig`` flags for TRL's GRPO script (TrlParser): the model and the exact adapter
    the trials ran. Not GRPOConfig fields, so they stay out of grpo_config.yaml, which a strict
    ``GRPOConfig`` parser reads too. ``--quantization`` travels in ``model_init_kwargs`` there."""
    argv = ["--model_name_or_path", model]
    if recipe.lora_rank:
        lora = lora_adapter(int(recipe.lora_rank))
        argv += [
            "--use_peft",
            "true",
            "--lora_r",
            str(lora["r"]),
            "--lora_alpha",
            str(lora["lora_alpha"]),
            "--lora_target_modules",
            lora["target_modules"],
            "--lora_dropout",
            str(lora["lora_dropout"]),
        ]
    return argv


@functools.lru_cache(maxsize=1)
def checkpointing_field() -> str:
    """The TrainingArguments field that turns activation recomputation on, in the installed
    transformers: ``activation_checkpointing`` where the class declares it (5.23 does, and warns
    that ``gradient_checkpointing`` is deprecated), else ``gradient_checkpointing`` (5.19 and older,
    and when transformers is not installed here: the old name is read by every release).

    Read from the class's source with :mod:`ast` rather than by importing it: transformers'
    training_args pulls in torch, seconds that a sim search's export should not pay.
    """
    try:
        source = importlib.metadata.distribution("transformers").locate_file("transformers/training_args.py")
        tree = parse(source.read_text(encoding="utf-8"))
    except (importlib.metadata.PackageNotFoundError, OSError, SyntaxError, ValueError):
        return "gradient_checkpointing"
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments":
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and getattr(item.target, "id", "") == "activation_checkpointing"
                ):
                    return "activation_checkpointing"
    return "gradient_checkpointing"


def grpo_config_kwargs(params: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """Keyword arguments for ``trl.GRPOConfig`` (and the grpo_config.yaml that TrlParser reads).

    vLLM fields that TRL uses only in colocate mode (memory fraction, sleep, tensor parallel,
    max model length) are written only then; a server takes them on its own command line.
    ``zero_stage``/``offload`` go to DeepSpeed and unknown parameters are dropped.
    """
    eff = effective(params, recipe)
    cpu = recipe.device == "cpu"
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": int(eff["per_device_train_batch_size"]),
        "gradient_accumulation_steps": int(eff["gradient_accumulation_steps"]),
        "num_generations": int(eff["num_generations"]),
        "max_completion_length": int(recipe.max_completion_length),
        checkpointing_field(): bool(eff["gradient_checkpointing"]),
        "beta": float(recipe.beta),
        "bf16": not cpu,
    }
    if cpu:
        kwargs["use_cpu"] = True
    kwargs["use_vllm"] = bool(eff["use_vllm"])
    if kwargs["use_vllm"]:
        kwargs["vllm_mode"] = str(eff["vllm_mode"])
        if kwargs["vllm_mode"] == "colocate":
            kwargs["vllm_gpu_memory_utilization"] = float(eff["vllm_gpu_memory_utilization"])
            kwargs["vllm_enable_sleep_mode"] = bool(eff["vllm_enable_sleep_mode"])
            kwargs["vllm_tensor_parallel_size"] = int(eff["vllm_tensor_parallel_size"])
            kwargs["vllm_max_model_length"] = vllm_max_model_length(recipe)
    for name in sorted(TRL_PASSTHROUGH & params.keys()):
        kwargs[name] = params[name]
    return kwargs


def vllm_serve_command(
    params: dict[str, Any], recipe: Recipe, model: str, port: int = DEFAULT_VLLM_SERVER_PORT
) -> list[str]:
    """``trl vllm-serve`` for server mode, on the GPUs left after training.

    The export keeps TRL's default port; a trial passes a free port of its own, so a stale or
    foreign server on the default port can never answer for it.
    """
    eff = effective(params, recipe)
    return [
        "trl",
        "vllm-serve",
        "--model",
        model,
        "--tensor_parallel_size",
        str(int(eff["vllm_tensor_parallel_size"])),
        "--max_model_len",
        str(vllm_max_model_length(recipe)),
        "--port",
        str(int(port)),
    ]
