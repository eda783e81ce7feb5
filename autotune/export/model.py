"""Which model the exported launch files name: something TRL's script and ms-swift can load.

The trials may have built a card from its config with random weights; the production run loads a
real model, so the files name what the user trains: a local checkpoint folder by its absolute path,
a model of the local Hugging Face cache by its hub id, a shipped card by the hub id it stands for,
and a local config-only folder as it is (its weights are the user's to add). A test card with no
hub id (``tiny-qwen``, a rehearsal) has nothing on any hub: it is written once as a model folder
with random weights and an offline tokenizer (:mod:`autotune.worker.materialise`, the folder the
swift runner's trials load), so the rehearsal's launch.sh and swift.sh train as they are.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from autotune.configs.swift_model import hub_id
from autotune.errors import UsageError
from autotune.models import resolve_model
from autotune.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportModel:
    """The model argument of launch.sh / swift.sh and a comment saying where it comes from."""

    name: str
    note: str
    rehearsal: bool = False  # a materialised test card: random weights, offline tokenizer


def export_model(recipe: Recipe) -> ExportModel:
    """The model the exported files name (see the module docstring)."""
    try:
        model = resolve_model(recipe.model)
    except UsageError:
        return ExportModel(recipe.model, f"the model as given (--model {recipe.model})")
    if model.has_weights and model.path:
        if model.source == "hf-cache":
            return ExportModel(recipe.model, f"{recipe.model} from the Hugging Face cache the trials loaded")
        folder = str(Path(model.path).resolve())
        return ExportModel(folder, "the local checkpoint folder the trials loaded")
    hub = hub_id(model, recipe.model)
    if hub:
        return ExportModel(hub, f"the hub id of card {model.name} (the trials built it with random weights)")
    if model.source == "path" and model.path:
        folder = str(Path(model.path).resolve())
        return ExportModel(folder, "the local folder the trials read the config from (add its weights)")
    return ExportModel(str(rehearsal_folder(model, recipe)), _REHEARSAL, rehearsal=True)


_REHEARSAL = (
    "a rehearsal: this test card has no hub id, so this folder holds its config with random weights "
    "and an offline tokenizer; name your real model instead"
)


def rehearsal_folder(model, recipe: Recipe) -> Path:
    """The test card as a model folder that loads, built by this interpreter (cached by content,
    shared with the swift runner's trials); its path when it cannot be built here (no torch)."""
    from autotune.worker.materialise import ensure_model, model_dir_for

    try:
        return ensure_model(sys.executable, model.name, model.config, recipe.device)
    except RuntimeError as exc:
        log.warning(
            "cannot write %s as a model folder here (%s): the launch files name where it goes",
            model.name,
            exc,
        )
        return model_dir_for(model.name, model.config, recipe.device)
