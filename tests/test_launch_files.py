"""What best/ ships runs as it is: the checkpointing field the installed transformers expects, the
exact LoRA adapter the trials measured, models named so that TRL's script and ms-swift load them,
and a template study's best/ holding only what it measured."""

import warnings

from autotune import configs as lc
from autotune.recipe import Recipe


def cpu_recipe(**kw) -> Recipe:
    base = dict(model="tiny-qwen", gpus=1, device="cpu", max_prompt_length=32, max_completion_length=16)
    base.update(kw)
    return Recipe(**base)


PARAMS = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_generations": 4,
    "zero_stage": 0,
    "offload": "none",
    "gradient_checkpointing": False,
    "use_vllm": False,
}


def test_exported_grpo_config_names_checkpointing_as_the_installed_transformers_does(tmp_path):
    """transformers 5.23 warns (FutureWarning) on gradient_checkpointing; the field it declares is
    written instead, and the value still reaches the config (TRL's default is True)."""
    import transformers
    import trl

    kwargs = lc.grpo_config_kwargs(PARAMS, cpu_recipe())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = trl.GRPOConfig(**kwargs, output_dir=str(tmp_path), report_to=[])
    assert config.gradient_checkpointing is False
    fields = set(transformers.TrainingArguments.__dataclass_fields__)
    expected = (
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    )
    assert lc.checkpointing_field() == expected and expected in kwargs
