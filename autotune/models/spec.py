"""One model's architecture (:class:`ModelSpec`): its shapes, read from ``config.json``, and the
exact parameter counts they add up to (see :mod:`autotune.models` for where configs come from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.models.parts import Quantization, VisionTower, checkpoint_quantization

__all__ = ["ModelSpec"]

#: Architectures whose q/k/v projections carry a bias regardless of ``attention_bias``
#: (Qwen2 hard-codes ``bias=True`` on q_proj, k_proj and v_proj, and ``bias=False`` on o_proj).
_QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_5_vl", "qwen2_vl"})
#: Architectures with a per-head RMSNorm on queries and keys (two weights of head_dim per layer).
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


@dataclass(frozen=True)
class ModelSpec:
    """One model's architecture, and where it was found.

    ``config`` is the ``config.json`` dictionary exactly as the model ships it (for cards, without
    the ``_card`` metadata), so it can be written back out and handed to
    ``transformers.AutoConfig`` to build the identical architecture with random weights.
    """

    name: str
    config: dict[str, Any]
    source: str  # "card" | "path" | "hf-cache"
    path: Path | None
    has_weights: bool
    #: The card's ``_card`` metadata (aliases, provenance, published size); empty otherwise.
    card: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- shapes ---------------------------------------------------------------------------
    # The sizes are cached on the instance (it is frozen and its config never changes): the planner
    # asks for them hundreds of thousands of times a search, once per candidate it estimates.
    @cached_property
    def _text(self) -> dict[str, Any]:
        """The language-model part of the config.

        Multimodal configs (Qwen2.5-VL and friends) may keep the decoder's shapes under
        ``text_config``; top-level keys win when both exist, as transformers does for these.
        """
        text = self.config.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in self.config:
            return {**text, **{k: v for k, v in self.config.items() if k != "text_config"}}
        return self.config

    def _require(self, key: str) -> Any:
        try:
            return self._text[key]
        except KeyError:
            raise UsageError(
                f"model {self.name!r}: config.json has no {key!r}; autotune needs a decoder-only "
                "causal LM config (hidden_size, num_hidden_layers, num_attention_heads, ...)"
            ) from None

    @property
    def model_type(self) -> str:
        """transformers' architecture key (``qwen2``, ``qwen3``, ``llama``...)."""
        return str(self.config.get("model_type", ""))

    @property
    def hidden_size(self) -> int:
        return int(self._require("hidden_size"))

    @property
    def num_layers(self) -> int:
        return int(self._require("num_hidden_layers"))

    @property
    def num_heads(self) -> int:
        return int(self._require("num_attention_heads"))

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads; configs without the key use full multi-head attention."""
        kv = self._text.get("num_key_value_heads")
        return int(kv) if kv is not None else self.num_heads

    @property
    def head_dim(self) -> int:
        """Per-head width: explicit in Qwen3 and Llama-3.2 (not always hidden / heads)."""
        explicit = self._text.get("head_dim")
        if explicit:
            return int(explicit)
        return self.hidden_size // self.num_heads

    @property
    def intermediate_size(self) -> int:
        return int(self._require("intermediate_size"))

    @property
    def vocab_size(self) -> int:
        return int(self._require("vocab_size"))

    @property
    def tied_embeddings(self) -> bool:
        """Whether lm_head shares the input embedding (transformers' default is tied)."""
        return bool(self._text.get("tie_word_embeddings", True))

    # -- sizes ----------------------------------------------------------------------------
    def _attention_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        weights = h * q_out + 2 * h * kv_out + q_out * h
        if self.model_type in _QKV_BIAS_MODEL_TYPES:
            biases = q_out + 2 * kv_out
        elif self._text.get("attention_bias", False):
            biases = q_out + 2 * kv_out + h  # Llama/Qwen3 put it on o_proj too
        else:
            biases = 0
        norms = 2 * hd if self.model_type in _QK_NORM_MODEL_TYPES else 0
        return weights + biases + norms

    def _mlp_params(self) -> int:
        h, inter = self.hidden_size, self.intermediate_size
        biases = 2 * inter + h if self._text.get("mlp_bias", False) else 0
        return 3 * h * inter + biases  # gate, up (h -> I) and down (I -> h) for SwiGLU

    def decoder_linear_shapes(self) -> list[tuple[int, int, int]]:
        """(fan_in, fan_out, how many) of the decoder blocks' linear layers (q, k, v, o, gate, up,
        down): what ``all-linear`` LoRA adapts and GPTQ/AWQ quantize."""
        h, inter, L = self.hidden_size, self.intermediate_size, self.num_layers
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [
            (h, q_out, L),
            (h, kv_out, L),
            (h, kv_out, L),
            (q_out, h, L),
            (h, inter, L),
            (h, inter, L),
            (inter, h, L),
        ]

    def linear_shapes(self) -> list[tuple[int, int, int]]:
        """Every linear layer but lm_head, the vision tower's included (peft's ``all-linear``)."""
        return self.decoder_linear_shapes() + (self.vision.linear_shapes() if self.vision else [])

    def quantized_shapes(self, quant: Quantization) -> list[tuple[int, int, int]]:
        """The linear layers ``quant`` stores quantized; everything else stays bf16."""
        if self.vision and quant.quantizes_vision():
            return self.linear_shapes()
        return self.decoder_linear_shapes()

    @cached_property
    def vision(self) -> VisionTower | None:
        """The vision tower of a vision-language config (None for a text-only model); a tower
        autotune cannot count is refused here rather than silently left out."""
        vision = self.config.get("vision_config")
        if not vision:
            return None
        return VisionTower.from_config(self.name, self.model_type, vision)

    @property
    def quantization(self) -> Quantization | None:
        """The checkpoint's own quantization (config.json's ``quantization_config``), or None."""
        return checkpoint_quantization(self.name, self.config)

    @cached_property
    def text_params(self) -> int:
        """Parameters of the language model: embeddings, per-layer attention (with Qwen2's q/k/v
        biases and Qwen3's q/k norms), the SwiGLU MLP, the two RMSNorms per layer and the final
        one, and lm_head when it is not tied (tied weights counted once)."""
        h = self.hidden_size
        embed = self.vocab_size * h
        per_layer = self._attention_params() + self._mlp_params() + 2 * h
        lm_head = 0 if self.tied_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + lm_head

    @cached_property
    def vision_params(self) -> int:
        return self.vision.num_params if self.vision else 0

    @cached_property
    def num_params(self) -> int:
        """Parameters of the model built from this config: the language model plus, for a
        vision-language model, its vision tower (trained, loaded by vLLM and gathered alike)."""
        return self.text_params + self.vision_params

    @property
    def largest_layer_params(self) -> int:
        """Parameters of the largest single module (its own, not its children's).

        DeepSpeed's ZeRO-3 estimator reserves ``4 * largest_layer`` bytes on each GPU for the
        module being gathered; for these LLMs it is the embedding (or the untied lm_head, the
        same size), but a very wide MLP projection could win on a small-vocabulary model.
        """
        h, hd = self.hidden_size, self.head_dim
        candidates = (
            self.vocab_size * h,
            h * self.intermediate_size,
            h * self.num_heads * hd,
        )
        return max(candidates)

    def transformers_config(self) -> Any:
        """This architecture as a ``transformers.PretrainedConfig`` (transformers imported lazily).

        For building a random-weight model in-process; the planner and the CLI never need
        transformers, so it is not imported at module load.
        """
        from transformers import AutoConfig

        kwargs = {k: v for k, v in self.config.items() if k not in ("model_type", "_card")}
        return AutoConfig.for_model(self.model_type, **kwargs)

    @property
    def published_params_b(self) -> float | None:
        """The size a model card publishes, in billions (cards only), for sanity checks."""
        value = self.card.get("params_b")
        return float(value) if value is not None else None
