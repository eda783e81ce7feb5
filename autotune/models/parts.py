"""What a base model adds beyond its decoder: a vision tower, and quantized weights.

Both change memory in ways the decoder's shapes do not show, so they are read from the same
``config.json`` rather than guessed:

- **Vision tower** (``vision_config``, Qwen2.5-VL): its parameters are trained (full fine-tuning)
  or carry LoRA adapters (``all-linear`` reaches its linears too), and it runs over
  ``image_tokens x spatial_merge_size**2`` patches per image, whose activations are kept for
  backward like a decoder layer's. Parameter counts are checked against transformers' own build in
  tests/test_models.py.
- **Quantized weights**: a checkpoint's ``quantization_config`` (GPTQ, AWQ, a saved bitsandbytes
  model) or ``--quantization 4bit|8bit`` (bitsandbytes in-flight). Bytes per weight matrix follow
  each format's storage: bitsandbytes NF4 keeps 4-bit codes plus one absmax per 64 weights (fp32,
  or 8-bit + an fp32 per 256 blocks with double quantization, QLoRA paper section 3); LLM.int8
  keeps int8 weights plus an fp32 scale per output row; GPTQ/AWQ pack ``bits``-bit weights with an
  fp16 scale and a packed zero point per ``group_size`` inputs per output (GPTQ adds an int32
  ``g_idx`` per input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.errors import UsageError

__all__ = [
    "Quantization",
    "VisionTower",
    "QUANTIZATION_FLAGS",
    "VISION_MODEL_TYPES",
    "flag_quantization",
    "checkpoint_quantization",
]

#: ``--quantization`` values and what they load: bitsandbytes NF4 with double quantization and
#: bf16 compute (the QLoRA recipe), or LLM.int8.
QUANTIZATION_FLAGS = ("4bit", "8bit")
#: Vision towers whose shapes autotune counts; any other ``vision_config`` is refused, not ignored.
VISION_MODEL_TYPES = frozenset({"qwen2_5_vl"})
NF4_BLOCK = 64  # bitsandbytes 4-bit blocksize (one absmax per 64 weights)
NF4_DQ_BLOCK = 256  # double quantization: absmax quantized to 8 bits in blocks of 256


@dataclass(frozen=True)
class Quantization:
    """How the frozen base's linear weights are stored.

    ``method``: ``nf4`` / ``int8`` (bitsandbytes), ``gptq`` or ``awq``. ``origin``: ``flag``
    (``--quantization``, quantized while loading) or ``checkpoint`` (a quantized checkpoint).
    """

    method: str
    bits: int
    group_size: int | None = None
    double_quant: bool = False
    origin: str = "flag"

    @property
    def label(self) -> str:
        if self.method == "nf4":
            return "4-bit NF4 (bitsandbytes" + (", double quant)" if self.double_quant else ")")
        if self.method == "int8":
            return "8-bit LLM.int8 (bitsandbytes)"
        return f"{self.method.upper()} int{self.bits}, group {self.group_size or 'per column'}"

    @property
    def bitsandbytes(self) -> bool:
        return self.method in ("nf4", "int8")

    def matrix_bytes(self, fan_in: int, fan_out: int) -> float:
        """Bytes of one ``fan_in x fan_out`` weight matrix in this format, scales included."""
        n = float(fan_in) * fan_out
        if self.method == "nf4":
            blocks = n / NF4_BLOCK
            absmax = blocks * (1 + 4 / NF4_DQ_BLOCK) if self.double_quant else blocks * 4
            return n / 2 + absmax
        if self.method == "int8":
            return n + 4.0 * fan_out
        group = self.group_size if self.group_size and self.group_size > 0 else fan_in
        groups = fan_in / group
        packed = n * self.bits / 8
        scales = groups * fan_out * 2  # fp16 scale per group and output
        zeros = groups * fan_out * self.bits / 8  # packed zero point per group and output
        g_idx = 4.0 * fan_in if self.method == "gptq" else 0.0
        return packed + scales + zeros + g_idx

    def quantizes_vision(self) -> bool:
        """bitsandbytes replaces every nn.Linear but lm_head, the vision tower's included;
        GPTQ/AWQ checkpoints quantize the decoder blocks they were calibrated on."""
        return self.bitsandbytes


def flag_quantization(flag: str | None) -> Quantization | None:
    """``--quantization`` as a :class:`Quantization` (None for none)."""
    if not flag:
        return None
    if flag == "4bit":
        return Quantization("nf4", 4, NF4_BLOCK, double_quant=True, origin="flag")
    if flag == "8bit":
        return Quantization("int8", 8, origin="flag")
    raise UsageError(f"--quantization {flag!r}: use 4bit (bitsandbytes NF4, QLoRA) or 8bit (LLM.int8)")


def checkpoint_quantization(name: str, config: dict[str, Any]) -> Quantization | None:
    """The ``quantization_config`` a checkpoint ships with, or None; an unknown format is refused
    (one line) rather than counted as bf16."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise UsageError(f"model {name!r}: quantization_config in config.json is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        return Quantization(method, bits, group, origin="checkpoint")
    if method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            return Quantization("nf4", 4, NF4_BLOCK, bool(qc.get("bnb_4bit_use_double_quant")), "checkpoint")
        if qc.get("load_in_8bit"):
            return Quantization("int8", 8, origin="checkpoint")
    raise UsageError(
        f"model {name!r}: config.json's quantization_config (quant_method {method or 'missing'!r}) is not "
        "modelled by autotune (it knows gptq, awq and bitsandbytes 4/8-bit): use the unquantized checkpoint "
        "with --quantization 4bit|8bit"
    )


@dataclass(frozen=True)
class VisionTower:
    """A Qwen2.5-VL vision encoder: Conv3d patch embedding, ``depth`` pre-norm blocks (RMSNorm,
    fused qkv + proj with biases, SwiGLU MLP with biases) and a patch merger (RMSNorm, then
    ``hidden*merge^2 -> hidden*merge^2 -> out_hidden`` with GELU)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    out_hidden: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3

    @classmethod
    def from_config(cls, name: str, model_type: str, vision: dict[str, Any]) -> VisionTower:
        if model_type not in VISION_MODEL_TYPES:
            raise UsageError(
                f"model {name!r}: its {model_type or 'unknown'} vision tower is not modelled by autotune "
                f"(it knows {', '.join(sorted(VISION_MODEL_TYPES))}); "
                "estimates would leave it out, so it is refused"
            )
        try:
            return cls(
                depth=int(vision["depth"]),
                hidden=int(vision["hidden_size"]),
                intermediate=int(vision["intermediate_size"]),
                heads=int(vision["num_heads"]),
                out_hidden=int(vision["out_hidden_size"]),
                patch_size=int(vision.get("patch_size", 14)),
                temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            )
        except KeyError as exc:
            raise UsageError(f"model {name!r}: vision_config has no {exc.args[0]!r}") from None

    @property
    def merged_width(self) -> int:
        return self.hidden * self.spatial_merge_size**2

    def linear_shapes(self) -> list[tuple[int, int, int]]:
        """(fan_in, fan_out, how many) of every linear layer: LoRA's and quantization's targets."""
        h, i, m = self.hidden, self.intermediate, self.merged_width
        d = self.depth
        return [(h, 3 * h, d), (h, h, d), (h, i, d), (h, i, d), (i, h, d), (m, m, 1), (m, self.out_hidden, 1)]

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden, self.intermediate, self.depth
        patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * h  # Conv3d, no bias
        block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h)
        merger = (
            h
            + (self.merged_width**2 + self.merged_width)
            + (self.merged_width * self.out_hidden + self.out_hidden)
        )
        return patch + d * block + merger

    @property
    def linear_params(self) -> int:
        return sum(fan_in * fan_out * n for fan_in, fan_out, n in self.linear_shapes())

    def patches(self, image_tokens: int) -> int:
        """Patches the encoder runs for an image that becomes ``image_tokens`` LLM tokens: the
        merger folds ``spatial_merge_size**2`` neighbouring patches into one token."""
        return int(image_tokens) * self.spatial_merge_size**2

    def activation_bytes_per_patch(self) -> float:
        """Bytes autograd keeps per patch in one block (bf16, SDPA): 31 x hidden + 8 x intermediate,
        counted with saved-tensor hooks on transformers 5's Qwen2_5_VLVisionBlock (tests/test_vl.py);
        more than a decoder layer's 26h because the vision rotary embedding works on fp32 q and k."""
        return 31 * self.hidden + 8 * self.intermediate
