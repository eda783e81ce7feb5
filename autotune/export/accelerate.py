"""accelerate's and DeepSpeed's files: accelerate_config.yaml and, for ZeRO >= 1 on GPUs, ds_config.json.

A DeepSpeed config that DeepSpeed or the HF integration would refuse (unknown keys, batch sizes
that do not multiply out) is never written: the export fails instead of shipping a broken run.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from autotune import configs
from autotune.recipe import Recipe


def ds_config_json(params: dict[str, Any], recipe: Recipe) -> str | None:
    """ds_config.json's text, or None when the run does not use DeepSpeed."""
    if not configs.uses_deepspeed(params, recipe):
        return None
    ds = configs.deepspeed_config(params, recipe)
    assert ds is not None
    problems = configs.deepspeed_schema_problems(ds) + configs.batch_problems(ds, params, recipe)
    if problems:
        raise ValueError("refusing to export an inconsistent DeepSpeed config: " + "; ".join(problems))
    return json.dumps(ds, indent=2) + "\n"


def accelerate_yaml(params: dict[str, Any], recipe: Recipe, ds_path: str | None) -> str:
    """accelerate_config.yaml's text, pointing at ``ds_path`` when DeepSpeed is used."""
    return yaml.safe_dump(configs.accelerate_config(params, recipe, ds_path), sort_keys=False)
