"""What a candidate means to DeepSpeed and accelerate: ds_config.json and the accelerate YAML.

Rules checked in the installed packages (accelerate 1.15, DeepSpeed 0.19):

* With ``deepspeed_config_file`` in an accelerate config, accelerate raises if the YAML also sets
  ``zero_stage``, ``offload_*_device``, ``gradient_accumulation_steps``, ``gradient_clipping``,
  ``zero3_save_16bit_model`` or the top-level ``mixed_precision`` (any value, even ``'no'``):
  they must live in the JSON. Precision then comes from TRL's ``bf16`` through the Trainer.
* DeepSpeed runs on CPU too (0.19.8, its CPU accelerator): a ``DEEPSPEED`` accelerate config with
  ``use_cpu`` starts torchrun, DeepSpeed picks gloo (``ccl`` only with oneCCL installed), and
  optimizer offload uses DeepSpeedCPUAdam (JIT-compiled on first use, cached in
  ``~/.cache/torch_extensions``). Pinned memory needs a GPU, so ``pin_memory`` is off on CPU;
  ``bf16`` is not written (a CPU trial runs float32). ``accelerate launch --cpu`` must not be used:
  it skips the DeepSpeed launcher.
"""

from __future__ import annotations

from typing import Any

from autotune.configs.trl import effective
from autotune.recipe import Recipe

ZERO_STAGES = (0, 1, 2, 3)

OFFLOADS = ("none", "optimizer", "optimizer+params")

# The values the HF integration fills for "auto" keys (TrainingArguments -> DeepSpeed).
AUTO = "auto"


def zero_stage_of(params: dict[str, Any]) -> int | None:
    """The ZeRO stage as an int, None when not given; a value outside 0-3 is a bug upstream."""
    stage = params.get("zero_stage")
    if stage is None:
        return None
    stage = int(stage)
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage {stage} is not one of {ZERO_STAGES}")
    return stage


def offload_of(params: dict[str, Any]) -> str:
    offload = params.get("offload") or "none"
    if offload not in OFFLOADS:
        raise ValueError(f"offload '{offload}' is not one of {', '.join(OFFLOADS)}")
    return offload


def uses_deepspeed(params: dict[str, Any], recipe: Recipe) -> bool:
    """Whether the run goes through DeepSpeed: ZeRO stage >= 1, on GPUs or on CPU.

    Stage 0 is plain data parallelism (DDP): it is what the space means by 0, and DDP is the
    faster launcher for it.
    """
    stage = zero_stage_of(params)
    return stage is not None and stage > 0


def deepspeed_config(params: dict[str, Any], recipe: Recipe) -> dict[str, Any] | None:
    """The DeepSpeed JSON for the candidate, or None when ``zero_stage`` is not given.

    Batch sizes, clipping and precision are ``"auto"`` so that the HF integration fills them from
    the GRPOConfig: one source of truth, no mismatch error. With optimizer offload an ``optimizer``
    section (also ``"auto"``) makes DeepSpeed use its CPU Adam, several times faster than
    running torch's AdamW on offloaded states.
    """
    stage = zero_stage_of(params)
    if stage is None:
        return None
    offload = offload_of(params)
    zero: dict[str, Any] = {"stage": stage}
    pin = recipe.device != "cpu"  # page-locked host memory is for GPU copies
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if stage >= 1:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": AUTO})
    if stage == 2:
        zero.update(
            {"allgather_partitions": True, "allgather_bucket_size": 500_000_000, "reduce_scatter": True}
        )
    if stage == 3:
        zero.update(
            {
                "sub_group_size": 1_000_000_000,
                "stage3_prefetch_bucket_size": AUTO,
                "stage3_param_persistence_threshold": AUTO,
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    config: dict[str, Any] = {}
    if recipe.device != "cpu":
        config["bf16"] = {"enabled": AUTO}
    if "offload_optimizer" in zero:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO},
        }
    config["zero_optimization"] = zero
    config.update(
        {
            "train_micro_batch_size_per_gpu": AUTO,
            "train_batch_size": AUTO,
            "gradient_accumulation_steps": AUTO,
            "gradient_clipping": AUTO,
        }
    )
    return config


def batch_values(params: dict[str, Any], recipe: Recipe) -> dict[str, int]:
    """What the HF integration will put in the ``"auto"`` batch keys for these params."""
    eff = effective(params, recipe)
    micro = int(eff["per_device_train_batch_size"])
    accum = int(eff["gradient_accumulation_steps"])
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * recipe.dp_gpus(eff),
    }


def batch_problems(config: dict[str, Any], params: dict[str, Any], recipe: Recipe) -> list[str]:
    """Why DeepSpeed's batch assertion would fail, or [] when the values are consistent.

    DeepSpeed asserts train_batch_size == micro x accumulation x data-parallel GPUs, and the HF
    integration raises when a concrete value disagrees with the TrainingArguments. ``"auto"``
    values are replaced by what the integration fills in before the check.
    """
    want = batch_values(params, recipe)
    problems: list[str] = []
    got: dict[str, int] = {}
    for key, value in want.items():
        concrete = config.get(key, AUTO)
        if concrete != AUTO and concrete != value:
            problems.append(f"{key} is {concrete} but the GRPO config gives {value}")
        got[key] = value if concrete == AUTO else int(concrete)
    dp = recipe.dp_gpus(effective(params, recipe))
    product = got["train_micro_batch_size_per_gpu"] * got["gradient_accumulation_steps"] * dp
    if got["train_batch_size"] != product:
        problems.append(
            f"train_batch_size {got['train_batch_size']} != micro "
            f"{got['train_micro_batch_size_per_gpu']} x accumulation "
            f"{got['gradient_accumulation_steps']} x {dp} data-parallel GPUs"
        )
    if recipe.global_batch and got["train_batch_size"] != recipe.global_batch:
        problems.append(
            f"train_batch_size {got['train_batch_size']} is not the recipe's global "
            f"batch {recipe.global_batch}"
        )
    return problems


# A documented subset of DeepSpeed's schema (deepspeed/runtime/zero/config.py, offload_config.py;
# DeepSpeed forbids unknown zero_optimization keys). Types: "int", "bool", "number", "dict",
# "str"; a trailing "|auto" means the HF integration fills "auto" there.
_TOP_SCHEMA = {
    "bf16": "dict",
    "fp16": "dict",
    "optimizer": "dict",
    "scheduler": "dict",
    "zero_optimization": "dict",
    "train_micro_batch_size_per_gpu": "int|auto",
    "train_batch_size": "int|auto",
    "gradient_accumulation_steps": "int|auto",
    "gradient_clipping": "number|auto",
    "steps_per_print": "int",
    "wall_clock_breakdown": "bool",
    "zero_allow_untested_optimizer": "bool",
}


_ZERO_SCHEMA = {
    "stage": "int",
    "offload_optimizer": "dict",
    "offload_param": "dict",
    "overlap_comm": "bool",
    "contiguous_gradients": "bool",
    "reduce_scatter": "bool",
    "reduce_bucket_size": "int|auto",
    "allgather_partitions": "bool",
    "allgather_bucket_size": "int",
    "round_robin_gradients": "bool",
    "sub_group_size": "int",
    "stage3_prefetch_bucket_size": "int|auto",
    "stage3_param_persistence_threshold": "int|auto",
    "stage3_max_live_parameters": "int",
    "stage3_max_reuse_distance": "int",
    "stage3_gather_16bit_weights_on_model_save": "bool",
}


_OFFLOAD_SCHEMA = {
    "device": "str",
    "pin_memory": "bool",
    "nvme_path": "str",
    "buffer_count": "int",
    "buffer_size": "int",
    "max_in_cpu": "int",
    "ratio": "number",
}


_PRECISION_SCHEMA = {"enabled": "bool|auto"}

_OPTIMIZER_PARAM_AUTO = {"lr", "betas", "eps", "weight_decay"}


def _type_ok(value: Any, kind: str) -> bool:
    kinds = kind.split("|")
    if "auto" in kinds and value == AUTO:
        return True
    base = kinds[0]
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "dict":
        return isinstance(value, dict)
    if base == "str":
        return isinstance(value, str)
    raise ValueError(f"unknown schema type {kind}")


def _check_keys(section: dict[str, Any], schema: dict[str, str], where: str) -> list[str]:
    problems = []
    for key, value in section.items():
        if key not in schema:
            problems.append(f"{where}{key} is not a known DeepSpeed key")
        elif not _type_ok(value, schema[key]):
            problems.append(f"{where}{key}={value!r} is not {schema[key]}")
    return problems


def deepspeed_schema_problems(config: dict[str, Any]) -> list[str]:
    """Key and type problems in a DeepSpeed config, checked without DeepSpeed installed.

    Also the rules DeepSpeed and the HF integration apply: stage 0-3, offload devices, parameter
    offload and ``stage3_*`` keys only at stage 3, ``"auto"`` only where the integration fills it.
    """
    problems = _check_keys(config, _TOP_SCHEMA, "")
    for name in ("bf16", "fp16"):
        if isinstance(config.get(name), dict):
            problems += _check_keys(config[name], _PRECISION_SCHEMA, f"{name}.")
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        if not isinstance(optimizer.get("type"), str):
            problems.append("optimizer.type must be a string")
        for key, value in (optimizer.get("params") or {}).items():
            if value == AUTO and key not in _OPTIMIZER_PARAM_AUTO:
                problems.append(f"optimizer.params.{key} cannot be 'auto'")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return problems + ["zero_optimization is missing (accelerate requires it with a config file)"]
    problems += _check_keys(zero, _ZERO_SCHEMA, "zero_optimization.")
    stage = zero.get("stage")
    if stage not in ZERO_STAGES:
        problems.append(f"zero_optimization.stage {stage!r} is not 0-3")
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name)
        if isinstance(section, dict):
            problems += _check_keys(section, _OFFLOAD_SCHEMA, f"zero_optimization.{name}.")
            if section.get("device") not in ("none", "cpu", "nvme"):
                problems.append(
                    f"zero_optimization.{name}.device {section.get('device')!r} is not none, cpu or nvme"
                )
    if stage != 3:
        if (zero.get("offload_param") or {}).get("device", "none") != "none":
            problems.append("offload_param needs ZeRO stage 3")
        problems += [
            f"zero_optimization.{k} is a stage-3 key at stage {stage}"
            for k in zero
            if k.startswith("stage3_")
        ]
    return problems


def accelerate_config(params: dict[str, Any], recipe: Recipe, ds_config_path: str | None) -> dict[str, Any]:
    """The ``accelerate launch --config_file`` YAML content, shaped like trl/accelerate_configs.

    With DeepSpeed it only points at the JSON (plus ``zero3_init_flag``): accelerate refuses a
    YAML that repeats stage, offload, accumulation, clipping or mixed precision next to a
    ``deepspeed_config_file``.
    """
    processes = recipe.dp_gpus(params)
    cpu = recipe.device == "cpu"
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if uses_deepspeed(params, recipe):
        if not ds_config_path:
            raise ValueError("a DeepSpeed run needs the path of its ds_config.json")
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(ds_config_path),
            "deepspeed_multinode_launcher": "standard",
            "zero3_init_flag": zero_stage_of(params) == 3,
        }
        config["distributed_type"] = "DEEPSPEED"
    else:
        if processes > 1:
            config["distributed_type"] = "MULTI_CPU" if cpu else "MULTI_GPU"
        else:
            config["distributed_type"] = "NO"
        if not cpu:
            config["gpu_ids"] = "all"
        config["mixed_precision"] = "no" if cpu else "bf16"
    config.update(
        {
            "downcast_bf16": "no",
            "machine_rank": 0,
            "main_training_function": "main",
            "num_machines": 1,
            "num_processes": processes,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": cpu,
        }
    )
    return config
