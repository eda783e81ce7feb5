"""What one candidate means to each trainer: TRL, DeepSpeed + accelerate, ms-swift.

Pure functions of (params, recipe). The runners build their trials from them and the export
writes the production files from them, so what ships is what was measured.
"""

from autotune.configs.deepspeed import (
    AUTO,
    OFFLOADS,
    ZERO_STAGES,
    accelerate_config,
    batch_problems,
    batch_values,
    deepspeed_config,
    deepspeed_schema_problems,
    offload_of,
    uses_deepspeed,
    zero_stage_of,
)
from autotune.configs.swift import (
    SWIFT_ONLY,
    SWIFT_PRESETS,
    SwiftVersion,
    TrialInputs,
    production_argv,
    swift_command,
    swift_deepspeed,
    swift_env,
    swift_rollout_command,
    swift_space_path,
    swift_trial_argv,
)
from autotune.configs.trl import (
    DEFAULT_VLLM_SERVER_PORT,
    LAUNCH_ONLY,
    TRL_DEFAULTS,
    TRL_PASSTHROUGH,
    checkpointing_field,
    effective,
    gpu_split,
    grpo_config_kwargs,
    is_vllm_server,
    lora_adapter,
    model_flags,
    vllm_max_model_length,
    vllm_serve_command,
)


def dropped_params(params: dict) -> list[str]:
    """Parameters that reach neither TRL, DeepSpeed, the launcher nor ms-swift (worth a note)."""
    used = set(TRL_DEFAULTS) | TRL_PASSTHROUGH | LAUNCH_ONLY | SWIFT_ONLY
    return sorted(k for k in params if k not in used)


__all__ = [
    "AUTO",
    "DEFAULT_VLLM_SERVER_PORT",
    "LAUNCH_ONLY",
    "OFFLOADS",
    "SWIFT_PRESETS",
    "TRL_DEFAULTS",
    "TRL_PASSTHROUGH",
    "ZERO_STAGES",
    "accelerate_config",
    "batch_problems",
    "batch_values",
    "checkpointing_field",
    "deepspeed_config",
    "deepspeed_schema_problems",
    "dropped_params",
    "effective",
    "gpu_split",
    "grpo_config_kwargs",
    "is_vllm_server",
    "lora_adapter",
    "model_flags",
    "offload_of",
    "swift_command",
    "swift_deepspeed",
    "swift_env",
    "swift_rollout_command",
    "SWIFT_ONLY",
    "SwiftVersion",
    "TrialInputs",
    "production_argv",
    "swift_space_path",
    "swift_trial_argv",
    "uses_deepspeed",
    "vllm_max_model_length",
    "vllm_serve_command",
    "zero_stage_of",
]
