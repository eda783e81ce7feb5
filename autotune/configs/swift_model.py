"""How a model and its prompts reach ms-swift, in trials and in the exported swift.sh.

A checkpoint with weights is passed by path; a shape-only card is materialised once as a model
directory (:mod:`autotune.worker.materialise`) and passed with ``--model_type`` and ``--template
qwen``, and swift.sh names it by its hub id when it has one. The prompts are ``--dataset`` as given
(a local file made absolute), else worst-case prompts the trial writes. The runner and the export
build the same :class:`TrialInputs` from here, so swift.sh is what the trials ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.configs.swift import TrialInputs
from autotune.models import ModelSpec
from autotune.recipe import Recipe

PROMPTS_FILE = "prompts.jsonl"
OUTPUT_DIR = "swift_output"
#: ms-swift's model types for the architectures autotune has cards for (config.json's model_type).
MODEL_TYPES = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llama": "llama",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}
#: The template of a materialised card: its tokenizer carries Qwen's chat markers.
SHAPE_TEMPLATE = "qwen"


def hub_id(model: ModelSpec, given: str) -> str | None:
    """A name ModelScope or the Hub resolves for a card: the alias with an organisation whose
    name is the one the user gave, else the card's first such alias; None for a test card."""
    ids = [a for a in model.card.get("aliases", []) if "/" in a]
    if "/" in given and model.source != "path":
        return given
    for alias in ids:
        if alias.split("/", 1)[1].lower() == given.lower():
            return alias
    return ids[0] if ids else None


@dataclass(frozen=True)
class SwiftModel:
    """How a model reaches ms-swift: in trials, and in the exported swift.sh."""

    shape_only: bool  # materialised from its config (no weights on disk)
    model_type: str | None
    export_model: str | None  # the hub id or path swift.sh names; None: the materialised folder
    export_template: bool  # whether swift.sh keeps the trial's --template


def swift_model(model: ModelSpec, recipe: Recipe) -> SwiftModel:
    """Weights on disk are passed by path; a card without them is materialised (see module doc)."""
    model_type = MODEL_TYPES.get(model.model_type)
    if model.has_weights and model.path:
        named = recipe.model if model.source == "hf-cache" else str(Path(model.path).resolve())
        return SwiftModel(False, model_type, named, True)
    hub = hub_id(model, recipe.model)
    return SwiftModel(True, model_type, hub, hub is None)


def dataset_arg(recipe: Recipe) -> str | None:
    """The user's prompts as swift should read them: a local file made absolute, else as given
    (ms-swift also takes a dataset id)."""
    if not recipe.dataset:
        return None
    path = Path(recipe.dataset).expanduser()
    if path.exists():
        return str(path.resolve())
    if recipe.workdir and (Path(recipe.workdir) / path).exists():
        return str((Path(recipe.workdir) / path).resolve())
    return recipe.dataset


def trial_inputs(
    recipe: Recipe,
    plan: SwiftModel,
    *,
    program: str,
    model: str,
    dataset: str,
    output_dir: str,
    max_steps: int,
    ds_config_path: str,
) -> TrialInputs:
    return TrialInputs(
        program=program,
        model=model,
        model_type=plan.model_type,
        template=SHAPE_TEMPLATE if plan.shape_only else None,
        dataset=dataset,
        output_dir=output_dir,
        max_steps=max_steps,
        ds_config_path=ds_config_path,
        truncate_left=not recipe.dataset,
    )
