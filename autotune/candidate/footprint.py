"""What each part of a GRPO training process holds, in bytes: the memory model's terms.

The parts (GiB per GPU):
- model states: weights, gradients and Adam states, by ZeRO stage and offload. Stage 0 is plain
  DDP on a bf16 model (the worker loads bf16): torch's AdamW keeps m and v in the parameters' dtype,
  so bf16 weights + grads + m + v = 8P. DeepSpeed's bf16 mode adds fp32 master weights, fp32 Adam
  states and an fp32 gradient partition: stage 1 4P + 16P/N, stages 2 and 3 DeepSpeed's own
  estimators (``estimate_zero2/3_model_states_mem_needs``: 2P + 18P/N, 4*largest layer + 18P/N),
  which on one GPU is 20P (measured on an H100: ZeRO-1/2 16.6 GiB over plain DDP for 1.54B
  parameters, 11.6 bytes per parameter; 20P - 8P = 12P). ZeRO-3 also keeps up to
  ``stage3_max_live_parameters`` (1e9 in autotune's ds_config) gathered. LoRA: frozen bf16 base
  weights, and states for the adapters only.
- activations: what autograd saves per decoder layer of an HF Llama/Qwen2 block in bf16 with SDPA
  attention and no dropout, counted with saved-tensor hooks (tests/test_memory.py does it on CPU):
  22h + 4*kv_dim + 8*intermediate bytes per token (RMSNorm keeps its fp32 input). With full
  recomputation 2*s*b*h per layer stay, plus one layer's full activations during backward, which
  comes after the logits are freed (so the peak is the larger of the two, not their sum).
- logits: the loss materialises micro_batch x completion x vocab logits, upcast to fp32 and kept
  with their log-softmax for backward: about 4.6x the bf16 tensor (2.9x in the no-grad log-prob
  pass, trl issue 3678). With Qwen's 152k vocabulary this is often the largest part.
- reference model when beta > 0 (bf16 weights, sharded under ZeRO-3).
- vLLM colocated: the engine takes its fraction of TOTAL memory; with sleep mode only a small
  leftover remains while training, but generation still needs the full fraction next to the
  trainer's model states.
- generation without vLLM: TRL's ``_generate_single_turn`` calls ``unwrapped_model.generate()``
  once on the whole local generation batch, per-device batch x steps_per_generation sequences
  (``_prepare_inputs`` generates every steps_per_generation steps). That phase holds the trainer's
  states (ZeRO-3 gathers the full bf16 weights, ``ds3_gather_for_generation``), the KV cache
  (2 x layers x kv_heads x head_dim x (prompt + completion) x sequences x 2 bytes), the prefill's
  working set (one layer's MLP, ~(3*intermediate + 4h) x 2 bytes per prompt token) and the
  sampler's fp32 last-token logits. The peak is the larger of the two phases.
- overhead: CUDA context, NCCL buffers, allocator slack.
- quantized bases (``--quantization`` or a GPTQ/AWQ checkpoint, LoRA only): the frozen base's
  linear weights in their stored format (:meth:`autotune.models.Quantization.matrix_bytes`, scales
  included), everything else bf16, plus a dequantization workspace (the largest quantized matrix
  dequantized to bf16 in forward and again in backward) and the bf16 LoRA adapters with their
  AdamW states (TRL 1.16 casts a quantized model's trainable parameters to bf16). vLLM loads a
  GPTQ/AWQ checkpoint quantized (its ``quantization_config``); for a bitsandbytes 4-bit policy TRL
  1.16 starts the colocated engine with ``quantization="bitsandbytes"`` (in-flight 4-bit, no double
  quantization counted) and refuses 8-bit (``vLLM does not support in-flight 8-bit quantization.``,
  trl/generation/vllm_generation.py).
- vision tower (Qwen2.5-VL): its parameters join the model states; ``image_tokens x images`` join
  the LLM's prompt; the encoder runs ``image_tokens x spatial_merge_size**2`` patches per image for
  every completion of the micro-batch (TRL repeats the prompt's images per completion) and keeps
  the same per-layer activations as a decoder layer of its width (2 x patches x hidden per block
  with checkpointing). ``all-linear`` LoRA reaches its linears, so it trains under LoRA too.
"""

from __future__ import annotations

from typing import Any

from autotune.errors import UsageError
from autotune.models import ModelSpec, Quantization, flag_quantization

# Peak memory of the logits per bf16 logits tensor (micro_batch x completion x vocab x 2 bytes).
# The no-grad log-prob forward peaks at ~2.9x (trl #3678); the training forward keeps fp32 logits
# and their log-softmax for backward, ~4.6x (open-r1 #615: 46 GB saved by a fused loss at
# 16 x 2048 x 151936). The training pass is the larger one, so it sets the peak.
LOGITS_PEAK_FACTOR = 4.6
LORA_TARGETS_PER_LAYER = 7  # q, k, v, o, gate, up, down ("all-linear")
GEN_LOGITS_FACTOR = 3.0  # fp32 last-token logits, their softmax and the sampled copy


def zero_model_states_bytes(
    params: int, largest_layer: int, stage: int, offload: str, n_gpus: int
) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) for weights + gradients + Adam states of a full fine-tune.

    Stages 2 and 3 follow DeepSpeed's estimators (CPU side with their 1.5 buffer factor); stage 1
    is stage 2 with unpartitioned bf16 gradients; stage 0 is torch AdamW on a bf16 model (8P).
    """
    P, N, LL = float(params), float(max(n_gpus, 1)), float(largest_layer)
    if stage == 3:
        if offload == "optimizer+params":
            return 4 * LL, P * 18 * 1.5
        if offload == "optimizer":
            return 4 * LL + 2 * P / N, P * max(4 * N, 16) * 1.5
        return 4 * LL + 18 * P / N, 0.0
    if stage == 2:
        if offload == "optimizer":
            return 2 * P, P * max(4 * N, 16) * 1.5
        return 2 * P + 18 * P / N, 0.0
    if stage == 1:
        return 4 * P + 16 * P / N, 0.0
    return 8 * P, 0.0


def lora_params(model: ModelSpec, rank: int) -> int:
    """Adapter parameters for rank-r LoRA on every linear layer (peft's ``all-linear``: every
    decoder block, and the vision tower of a vision-language model)."""
    return sum(rank * (fan_in + fan_out) * n for fan_in, fan_out, n in model.linear_shapes())


def base_quantization(model: ModelSpec, flag: str | None, lora_rank: int | None) -> Quantization | None:
    """How the frozen base is stored: ``--quantization`` or the checkpoint's own format.

    Refused (one line, exit 2): both at once, and either without LoRA, because quantized weights
    take no gradient (full fine-tuning of a 4/8-bit base is not something TRL or peft can do).
    """
    own = model.quantization
    asked = flag_quantization(flag)
    if own and asked:
        raise UsageError(f"model {model.name!r} is already quantized ({own.label}): drop --quantization")
    quant = own or asked
    if quant and not lora_rank:
        what = f"--quantization {flag}" if asked else f"model {model.name!r} ({quant.label})"
        raise UsageError(
            f"{what} trains adapters on a frozen quantized base: add --lora-rank R (e.g. 16); "
            "quantized weights cannot be fully fine-tuned"
        )
    return quant


def weight_bytes(model: ModelSpec, quant: Quantization | None) -> float:
    """Bytes of the base's weights: bf16, or its quantized linears in their format + the rest bf16."""
    if quant is None:
        return 2.0 * model.num_params
    shapes = model.quantized_shapes(quant)
    quantized = sum(fan_in * fan_out * n for fan_in, fan_out, n in shapes)
    packed = sum(quant.matrix_bytes(fan_in, fan_out) * n for fan_in, fan_out, n in shapes)
    return packed + 2.0 * (model.num_params - quantized)


def dequant_workspace_bytes(model: ModelSpec, quant: Quantization | None) -> float:
    """The largest quantized matrix dequantized to bf16, once in forward and once in backward."""
    if quant is None:
        return 0.0
    return 2 * 2.0 * max(fan_in * fan_out for fan_in, fan_out, _ in model.quantized_shapes(quant))


def vllm_weight_bytes(model: ModelSpec, quant: Quantization | None, tp: int) -> float:
    """What the colocated engine loads per GPU: a GPTQ/AWQ checkpoint as stored, a bitsandbytes
    4-bit policy in-flight 4-bit (TRL passes ``quantization="bitsandbytes"``), else bf16."""
    if quant is None or quant.method == "int8":
        return weight_bytes(model, None) / tp
    if quant.bitsandbytes:
        return weight_bytes(model, Quantization("nf4", 4, quant.group_size, double_quant=False)) / tp
    return weight_bytes(model, quant) / tp


def model_states(
    model: ModelSpec,
    params: dict[str, Any],
    n_gpus: int,
    lora_rank: int | None,
    quant: Quantization | None = None,
) -> tuple[float, float]:
    stage = int(params.get("zero_stage", 0))
    offload = str(params.get("offload", "none"))
    P, LL = model.num_params, model.largest_layer_params
    if lora_rank:
        A = lora_params(model, lora_rank)
        W = weight_bytes(model, quant)
        base = W / max(n_gpus, 1) + 4 * LL if stage == 3 else W
        if offload == "optimizer+params" and stage == 3:
            base = 4 * LL
        states_gpu, states_cpu = zero_model_states_bytes(A, 0, stage, offload, n_gpus)
        return base + states_gpu + dequant_workspace_bytes(model, quant), states_cpu
    return zero_model_states_bytes(P, LL, stage, offload, n_gpus)


def vision_activation_bytes(
    model: ModelSpec, micro_batch: int, image_tokens: int, images: int, checkpointing: bool
) -> float:
    """What the vision encoder keeps for backward over one micro-batch's images (0 without)."""
    tower = model.vision
    if tower is None or image_tokens <= 0 or images <= 0:
        return 0.0
    patches = micro_batch * images * tower.patches(image_tokens)
    per_block = patches * tower.activation_bytes_per_patch()
    if checkpointing:
        return 2.0 * patches * tower.hidden * tower.depth + per_block
    return per_block * tower.depth


def layer_activation_bytes_per_token(model: ModelSpec) -> float:
    """Bytes autograd saves per token in one decoder layer (bf16, SDPA, no dropout)."""
    h = model.hidden_size
    return 22 * h + 4 * model.num_kv_heads * model.head_dim + 8 * model.intermediate_size


def activation_bytes(
    model: ModelSpec, micro_batch: int, seq: int, checkpointing: bool
) -> tuple[float, float]:
    """(kept through the logits, one layer's recomputation during backward) in bytes."""
    h, L = model.hidden_size, model.num_layers
    per_layer_full = seq * micro_batch * layer_activation_bytes_per_token(model)
    if checkpointing:
        return 2 * seq * micro_batch * h * L, per_layer_full
    return per_layer_full * L, 0.0


def generation_bytes(model: ModelSpec, sequences: float, prompt: int, completion: int) -> float:
    """One HF ``generate()`` over ``sequences``: KV cache at full length, the prefill's working
    set (one layer's MLP over every prompt token) and the sampler's last-token logits."""
    kv = kv_bytes_per_token(model) * (prompt + completion) * sequences
    prefill = sequences * prompt * (3 * model.intermediate_size + 4 * model.hidden_size) * 2
    sampling = sequences * model.vocab_size * 4 * GEN_LOGITS_FACTOR
    return kv + prefill + sampling


def logits_bytes(model: ModelSpec, micro_batch: int, completion: int) -> float:
    return micro_batch * completion * model.vocab_size * 2 * LOGITS_PEAK_FACTOR


def kv_bytes_per_token(model: ModelSpec) -> float:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2
