"""What a candidate means to ms-swift: the ``swift rlhf --rlhf_type grpo`` command line (4.x names)."""

from __future__ import annotations

from typing import Any

from autotune.configs.deepspeed import offload_of, uses_deepspeed, zero_stage_of
from autotune.configs.trl import DEFAULT_VLLM_SERVER_PORT, effective, gpu_split, vllm_max_model_length
from autotune.recipe import Recipe


# ms-swift's --deepspeed presets (swift/config/*.json in ms-swift >= 3.0; zero3_offload offloads both
# optimizer and parameters there; in 2.x it offloaded parameters only, so 2.x is not targeted).
SWIFT_PRESETS: dict[tuple[int, str], str] = {
    (1, "none"): "zero1",
    (2, "none"): "zero2",
    (2, "optimizer"): "zero2_offload",
    (3, "none"): "zero3",
    (3, "optimizer+params"): "zero3_offload",
}


def swift_deepspeed(params: dict[str, Any], recipe: Recipe) -> str | None:
    """ms-swift's ``--deepspeed`` preset for the stage/offload, or None when there is none.

    None also for no DeepSpeed at all; tell the two apart with :func:`uses_deepspeed`.
    """
    if not uses_deepspeed(params, recipe):
        return None
    return SWIFT_PRESETS.get((zero_stage_of(params) or 0, offload_of(params)))


def _flag(value: bool) -> str:
    return "true" if value else "false"


def swift_command(params: dict[str, Any], recipe: Recipe, model: str, *,
                  ds_config_path: str = "ds_config.json") -> list[str]:
    """The ``swift rlhf --rlhf_type grpo`` argv (ms-swift 4.x names) for the same configuration.

    Every tuned value is written, since ms-swift's defaults differ from TRL's. A stage/offload
    pair without a swift preset (e.g. ZeRO-3 with optimizer-only offload) is passed as the path of
    our own DeepSpeed JSON, which ``--deepspeed`` also accepts. TRL's sleep mode is vLLM sleep
    level 2, so ``--sleep_level 2``. Dataset and reward functions are the user's to add.
    """
    eff = effective(params, recipe)
    cpu = recipe.device == "cpu"
    argv = ["swift", "rlhf", "--rlhf_type", "grpo", "--model", model,
            "--tuner_type", "lora" if recipe.lora_rank else "full"]
    if recipe.lora_rank:
        argv += ["--lora_rank", str(int(recipe.lora_rank))]
    argv += [
        "--torch_dtype", "float32" if cpu else "bfloat16",
        "--per_device_train_batch_size", str(int(eff["per_device_train_batch_size"])),
        "--gradient_accumulation_steps", str(int(eff["gradient_accumulation_steps"])),
        "--num_generations", str(int(eff["num_generations"])),
        "--max_length", str(int(recipe.max_prompt_length)),
        "--max_completion_length", str(int(recipe.max_completion_length)),
        "--gradient_checkpointing", _flag(bool(eff["gradient_checkpointing"])),
        "--beta", str(float(recipe.beta)),
    ]
    if uses_deepspeed(params, recipe):
        argv += ["--deepspeed", swift_deepspeed(params, recipe) or str(ds_config_path)]
    use_vllm = bool(eff["use_vllm"])
    argv += ["--use_vllm", _flag(use_vllm)]
    if use_vllm:
        mode = str(eff["vllm_mode"])
        argv += ["--vllm_mode", mode]
        if mode == "colocate":
            argv += [
                "--vllm_gpu_memory_utilization", str(float(eff["vllm_gpu_memory_utilization"])),
                "--vllm_tensor_parallel_size", str(int(eff["vllm_tensor_parallel_size"])),
                "--vllm_max_model_len", str(vllm_max_model_length(recipe)),
                "--sleep_level", "2" if eff["vllm_enable_sleep_mode"] else "0",
            ]
        else:
            argv += ["--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(DEFAULT_VLLM_SERVER_PORT)]
    for name in ("use_liger_kernel", "steps_per_generation", "generation_batch_size"):
        if name in params:
            value = params[name]
            argv += [f"--{name}", _flag(value) if isinstance(value, bool) else str(value)]
    return argv


def swift_rollout_command(params: dict[str, Any], recipe: Recipe, model: str) -> list[str]:
    """``swift rollout`` (ms-swift's vLLM server) for server mode."""
    eff = effective(params, recipe)
    return ["swift", "rollout", "--model", model,
            "--vllm_tensor_parallel_size", str(int(eff["vllm_tensor_parallel_size"])),
            "--vllm_max_model_len", str(vllm_max_model_length(recipe)),
            "--port", str(DEFAULT_VLLM_SERVER_PORT)]


def swift_env(params: dict[str, Any], recipe: Recipe) -> dict[str, str]:
    """NPROC_PER_NODE (training processes) and the training GPUs for swift.sh."""
    train, _ = gpu_split(params, recipe)
    return {"NPROC_PER_NODE": str(len(train)), "CUDA_VISIBLE_DEVICES": ",".join(map(str, train))}
