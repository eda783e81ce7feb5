"""A study's identity: what every controller joining one study must agree on (kept in the study by
:func:`autotune.study.storage.check_identity`, so a node without recipe.yaml is checked too)."""

from __future__ import annotations

import json
from typing import Any

from autotune.recipe import Recipe


def identity_of(recipe: Recipe) -> dict[str, Any]:
    """What controllers joining one study must agree on: the recipe's identity, less the storage
    URL (each node may reach the same server under another name)."""
    ident = {k: v for k, v in recipe.identity().items() if k != "storage"}
    return json.loads(json.dumps(ident, sort_keys=True, default=str))


def identity_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Identity fields both recipes have and that differ (a field added to autotune later is not a
    difference: studies started before it must stay resumable)."""
    return [k for k in sorted(set(mine) & set(theirs)) if mine[k] != theirs[k]]
