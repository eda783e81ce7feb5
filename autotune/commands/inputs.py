"""The recipe's inputs resolved and checked (model, hardware, space, pins), and the trial context
a study's runner is made from: shared by ``search``, ``estimate`` and the commands that reopen a study."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError
from autotune.hardware import find_gpu_type, resolve_hardware, unlisted_gpu, visible_gpus
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.runners import TrialContext
from autotune.units import GIB


def resolve_inputs(
    recipe: Recipe,
    gpu_type: str | None,
    gpu_memory: float | None,
    space_path: Path | None,
    raw_pins: dict[str, str],
) -> None:
    """Check model, hardware, space and pins, filling the recipe's resolved fields."""
    if int(recipe.image_tokens or 0) < 0:
        raise UsageError(
            f"--image-tokens {recipe.image_tokens}: tokens per image cannot be negative "
            "(0: text-only prompts)"
        )
    if int(recipe.images_per_prompt) < 1:
        raise UsageError(
            f"--images-per-prompt {recipe.images_per_prompt} must be at least 1 "
            "(text-only prompts: leave --image-tokens at 0)"
        )
    resolve_model(recipe.model)
    if recipe.device == "cpu" and recipe.runner != "sim":
        # CPU trials: the "device memory" is the per-trial cap, or the host's RAM
        import psutil

        if recipe.gpus < 1:
            raise UsageError("--gpus must be at least 1 (with --device cpu: the number of processes)")
        recipe.gpu_type = "CPU"
        recipe.gpu_memory_gib = float(
            recipe.memory_limit_gib or round(psutil.virtual_memory().total / GIB, 1)
        )
    else:
        real = recipe.runner in ("trl", "swift")
        need_visible = recipe.runner == "command" or (real and recipe.device == "cuda")
        if real and not visible_gpus():
            trainer = "TRL" if recipe.runner == "trl" else "ms-swift"
            raise UsageError(
                f"no GPU is visible for real {trainer} trials: use --device cpu for a CPU rehearsal "
                "with real trials, or --runner sim --gpu-type TYPE to simulate GPUs"
            )
        gpu = resolve_hardware(recipe.gpus, gpu_type, gpu_memory, need_visible=need_visible)
        recipe.gpu_type, recipe.gpu_memory_gib = gpu.name, gpu.memory_gib
    if space_path is None and recipe.runner == "swift":
        from autotune.configs import swift_space_path  # ms-swift's own knobs beside the shared ones

        space_path = swift_space_path()
    space = load_space(space_path)
    recipe.space, recipe.space_digest = str(space.path), space.digest
    if recipe.dataset:
        dataset = Path(recipe.dataset).expanduser()
        if not dataset.is_file():
            raise UsageError(
                f"--dataset {recipe.dataset}: no such file (give a JSONL file with a 'prompt' field)"
            )
        recipe.dataset = str(dataset.resolve())  # trials run in their own folders
    constraints.pin(recipe, space, raw_pins)


def context_for(recipe: Recipe) -> TrialContext:
    """The model, GPU type and space a study's trials run with (a GPU type NVML named but the
    table does not know keeps its memory, with generic bandwidth figures)."""
    try:
        gpu = replace(find_gpu_type(recipe.gpu_type), memory_gib=recipe.gpu_memory_gib)
    except UsageError:
        gpu = unlisted_gpu(recipe.gpu_type, recipe.gpu_memory_gib)
    space = load_space(recipe.space or None)
    if recipe.space_digest and space.digest != recipe.space_digest:
        raise UsageError(
            f"the search space {space.path} is not the one this study was started with (its digest "
            f"{space.digest} differs from {recipe.space_digest}): restore that file, or start a new "
            "study with another --name"
        )
    return TrialContext(recipe=recipe, space=space, model=resolve_model(recipe.model), gpu=gpu)
