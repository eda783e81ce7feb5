import pytest

from autotune.candidate.batch import completions_per_step
from autotune.errors import UsageError
from autotune.hardware import GPU_TYPES, find_gpu_type, resolve_hardware
from autotune.recipe import Recipe, default_study_name, parse_duration


@pytest.mark.parametrize(
    "text,seconds",
    [("8h", 28800), ("90m", 5400), ("45s", 45), ("1h30m", 5400), ("120", 120), ("1.5d", 129600)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "8x", "-1h", "0", "h8", "8hm", "mm5", "m"])
def test_bad_durations(text):
    with pytest.raises(UsageError):
        parse_duration(text)


def test_recipe_roundtrip_and_identity(tmp_path, recipe_factory):
    recipe = recipe_factory(pins={"num_generations": 8}, global_batch=256)
    recipe.save(tmp_path / "recipe.yaml")
    loaded = Recipe.load(tmp_path / "recipe.yaml")
    assert loaded == recipe
    more = Recipe.load(tmp_path / "recipe.yaml")
    more.trials = 100  # not part of identity: resume may raise it
    assert recipe.differences(more) == []
    more.gpus = 8
    assert recipe.differences(more) == ["gpus"]


def test_completions_per_step(recipe_factory):
    r = recipe_factory()
    assert (
        completions_per_step({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8}, r) == 128
    )


def test_gpu_table_has_common_types():
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "L40S", "A10G", "RTX-4090"):
        assert name in GPU_TYPES
    assert find_gpu_type("a100_80gb").name == "A100-80GB"
    with pytest.raises(UsageError, match="unknown GPU type 'B300'.*A100-40GB"):
        find_gpu_type("B300")


def test_hardware_needs_a_description_without_gpus():
    with pytest.raises(UsageError, match="--gpus must be at least 1"):
        resolve_hardware(0, "A100-80GB", None, need_visible=False)
    assert resolve_hardware(2, None, 24, need_visible=False).memory_gib == 24
    assert resolve_hardware(2, "H100-80GB", 70, need_visible=False).memory_gib == 70


def test_study_names_are_filesystem_safe():
    assert default_study_name("Qwen/Qwen2.5-7B-Instruct", 4, "A100-80GB") == "qwen2.5-7b-instruct-4xa100-80gb"
