"""Model architectures: where a model's shapes come from, and what they add up to.

A tuning search has to run on a model's exact shapes (hidden size, vocabulary, layer count...)
because those shapes decide memory: the logits tensor is batch x length x vocab, ZeRO-3 needs the
largest layer gathered at once, and the vLLM KV cache grows with layers x kv_heads x head_dim.
The weights themselves do not matter for memory or speed, so when they are not on disk a trial
can build the same architecture with random weights from ``config.json`` alone.

:func:`resolve_model` finds that ``config.json``, in this order:

1. a local directory holding ``config.json`` (a checkpoint the user already has);
2. the local Hugging Face cache (``models--Org--Name/snapshots/*/config.json``), so a model
   downloaded once is used offline, with its weights when they are there;
3. a shipped card (``autotune/cards/*.json``): the exact ``config.json`` of a popular model,
   so a search can plan and run on a machine that has never downloaded it.

Parameter counts are computed from the shapes rather than read from a model card, because the
memory model needs the exact count of the architecture that will really be built (model cards
round, and some count tied embeddings twice).

Modules: :mod:`~autotune.models.lookup` (where a config comes from), :mod:`~autotune.models.spec`
(what its shapes add up to), :mod:`~autotune.models.parts` (what a vision tower or quantized
weights add).
"""

from autotune.models.lookup import known_models, load_card, resolve_model, write_config_dir
from autotune.models.parts import QUANTIZATION_FLAGS, Quantization, VisionTower, flag_quantization
from autotune.models.spec import ModelSpec

__all__ = [
    "ModelSpec",
    "QUANTIZATION_FLAGS",
    "Quantization",
    "VisionTower",
    "flag_quantization",
    "known_models",
    "load_card",
    "resolve_model",
    "write_config_dir",
]
