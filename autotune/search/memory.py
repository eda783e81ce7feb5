"""A memory model for GRPO training: predicted peak memory per GPU, as a sum of named parts.

Why a model at all: a trial costs minutes of GPU time, a prediction costs microseconds. The
planner uses this to skip candidates that cannot fit and to start the search near the memory
boundary; the search then corrects it with every measured peak and every OOM (``calibrate``).

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

It also states vLLM's start-up conditions: the fraction must fit in what the trainer leaves free,
and the KV cache left after vLLM's own weights must hold one prompt+completion sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.errors import UsageError
from autotune.models import ModelSpec, Quantization, flag_quantization
from autotune.units import GIB

# Peak memory of the logits per bf16 logits tensor (micro_batch x completion x vocab x 2 bytes).
# The no-grad log-prob forward peaks at ~2.9x (trl #3678); the training forward keeps fp32 logits
# and their log-softmax for backward, ~4.6x (open-r1 #615: 46 GB saved by a fused loss at
# 16 x 2048 x 151936). The training pass is the larger one, so it sets the peak.
LOGITS_PEAK_FACTOR = 4.6
CUDA_CONTEXT_GIB = 0.8
NCCL_GIB = 0.5
VLLM_SLEEP_LEFTOVER_GIB = 0.6
VLLM_RUNTIME_GIB = 1.0  # activations, CUDA graphs and sampler buffers inside its budget
LORA_TARGETS_PER_LAYER = 7  # q, k, v, o, gate, up, down ("all-linear")
ZERO3_MAX_LIVE_PARAMS = 1e9  # stage3_max_live_parameters in configs/deepspeed.py
GEN_LOGITS_FACTOR = 3.0  # fp32 last-token logits, their softmax and the sampled copy
# How far off the model has been on measured peaks (test_memory.py's H100 cases: 6 runs, largest
# error 5.3%) and on published figures (trl#3456, within 30%): what ``estimate`` prints beside its
# verdict. Not a confidence interval: a handful of points on Qwen2.5 shapes.
TYPICAL_REL_ERROR = 0.06


@dataclass
class Estimate:
    """Predicted peak per GPU and its parts, plus the verdicts the planner needs."""

    model_states_gib: float
    activations_gib: float
    logits_gib: float
    reference_gib: float
    vllm_gib: float
    overhead_gib: float
    total_gib: float
    capacity_gib: float
    fits: bool
    host_gib: float = 0.0  # offloaded states in host RAM (all GPUs of the node)
    generation_gib: float = 0.0  # HF generate() without vLLM: KV cache + prefill + sampling
    generation_sequences: int = 0  # sequences in that one generate() call per GPU
    phase: str = "training"  # which phase sets the peak: training | generation
    vllm_problem: str | None = None  # 'vllm_kv' | 'vllm_startup' when vLLM cannot start
    vision_gib: float = 0.0  # vision encoder activations (vision-language models)
    quantization: str | None = None  # how the base's weights are stored, when quantized
    notes: list[str] = field(default_factory=list)
    # the parts that add up to the peak (training or generation phase, whichever is larger):
    # what calibration regresses measured peaks on
    features: dict[str, float] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("features", None)
        for k, v in data.items():
            if isinstance(v, float):
                data[k] = round(v, 3)
        return data

    @property
    def parts(self) -> dict[str, float]:
        """The parts that add up to the training peak (``vision`` only for vision-language models)."""
        parts = {
            "model_states": self.model_states_gib,
            "activations": self.activations_gib,
            "logits": self.logits_gib,
            "reference": self.reference_gib,
            "vllm": self.vllm_gib,
            "overhead": self.overhead_gib,
        }
        if self.vision_gib:
            parts["vision"] = self.vision_gib
        return parts


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


def generation_sequences(params: dict[str, Any], dp: int) -> int:
    """Sequences one ``generate()`` call decodes per GPU without vLLM (0 with vLLM): TRL's local
    generation batch, per-device batch x steps_per_generation (accumulation unless the space sets
    steps_per_generation, or generation_batch_size / data-parallel GPUs)."""
    if params.get("use_vllm"):
        return 0
    if params.get("generation_batch_size") is not None:
        return -(-int(params["generation_batch_size"]) // max(dp, 1))
    steps = params.get("steps_per_generation")
    steps = int(params.get("gradient_accumulation_steps", 1) if steps is None else steps)
    return int(params.get("per_device_train_batch_size", 8)) * max(steps, 1)


def logits_bytes(model: ModelSpec, micro_batch: int, completion: int) -> float:
    return micro_batch * completion * model.vocab_size * 2 * LOGITS_PEAK_FACTOR


def kv_bytes_per_token(model: ModelSpec) -> float:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2


def estimate(
    model: ModelSpec,
    params: dict[str, Any],
    *,
    gpus: int,
    capacity_gib: float,
    max_prompt_length: int,
    max_completion_length: int,
    beta: float = 0.0,
    lora_rank: int | None = None,
    dp_gpus: int | None = None,
    quantization: str | None = None,
    image_tokens: int = 0,
    images_per_prompt: int = 1,
) -> Estimate:
    """Predict the peak memory per GPU of one GRPO candidate, part by part (the planner calibrates
    the parts to measured peaks through :attr:`Estimate.features`).

    ``quantization`` is the recipe's ``--quantization`` (a checkpoint's own quantization_config is
    read from ``model``); ``image_tokens`` x ``images_per_prompt`` tokens join every prompt.
    Raises :class:`UsageError` for a quantized base without LoRA, and for image tokens on a
    text-only model.
    """
    n = dp_gpus or gpus
    b = int(params.get("per_device_train_batch_size", 8))
    if image_tokens and model.vision is None:
        raise UsageError(
            f"--image-tokens {image_tokens}: model {model.name!r} has no vision tower (a text-only "
            "config); drop --image-tokens or use a vision-language model such as Qwen2.5-VL-3B"
        )
    images = int(images_per_prompt) if image_tokens else 0
    max_prompt_length = int(max_prompt_length) + int(image_tokens) * images
    seq = max_prompt_length + max_completion_length
    stage = int(params.get("zero_stage", 0))
    quant = base_quantization(model, quantization, lora_rank)
    gpu_states, host_states = model_states(model, params, n, lora_rank, quant)
    if stage == 3 and not lora_rank:  # parameters ZeRO-3 keeps gathered between uses
        gpu_states += 2 * min(model.num_params, ZERO3_MAX_LIVE_PARAMS)
    kept, recompute = activation_bytes(model, b, seq, bool(params.get("gradient_checkpointing", True)))
    logits = logits_bytes(model, b, max_completion_length)
    # with recomputation one layer's activations come back only after the logits are freed
    acts = kept + max(recompute - logits, 0.0)
    ref = 0.0
    if beta and not lora_rank:  # with LoRA the reference is the base model with adapters off
        ref = 2 * model.num_params / (n if stage == 3 else 1)
    overhead = (CUDA_CONTEXT_GIB + (NCCL_GIB if n > 1 else 0.0)) * GIB
    vision = vision_activation_bytes(
        model, b, image_tokens, images, bool(params.get("gradient_checkpointing", True))
    )

    parts = {
        "model_states": gpu_states / GIB,
        "activations": acts / GIB,
        "logits": logits / GIB,
        "reference": ref / GIB,
        "overhead": overhead / GIB,
    }
    if vision:
        parts["vision"] = vision / GIB
    static = parts["model_states"] + parts["reference"] + parts["overhead"]
    notes = _base_notes(model, quant, lora_rank, b, image_tokens, images, vision)
    vllm = 0.0
    problem = None
    gen_peak, gen_features = 0.0, {}
    use_vllm = bool(params.get("use_vllm", False))
    mode = params.get("vllm_mode", "colocate")
    sequences = generation_sequences(params, n)
    generation = 0.0
    if sequences:  # transformers' generate() in the trainer's process
        kv = kv_bytes_per_token(model) * seq * sequences / GIB
        generation = generation_bytes(model, sequences, max_prompt_length, max_completion_length) / GIB
        sampling = sequences * model.vocab_size * 4 * GEN_LOGITS_FACTOR / GIB
        gathered = 2 * model.num_params / GIB if stage == 3 else 0.0  # ds3_gather_for_generation
        gen_peak = static + gathered + generation
        gen_features = {
            "model_states": parts["model_states"] + parts["reference"] + gathered,
            "activations": generation - sampling,
            "logits": sampling,
            "vllm": 0.0,
            "overhead": parts["overhead"],
        }
        notes.append(
            f"generation without vLLM: one generate() over {sequences} sequences x {seq} tokens "
            f"per GPU, {kv:.1f} GiB of KV cache, {generation:.1f} GiB in all"
        )
    if use_vllm and mode == "colocate":
        frac = float(params.get("vllm_gpu_memory_utilization", 0.3))
        tp = int(params.get("vllm_tensor_parallel_size", 1))
        budget = frac * capacity_gib
        weights = vllm_weight_bytes(model, quant, tp) / GIB
        if quant is not None and quant.method == "int8":
            problem = "invalid"
            notes.append(
                "TRL 1.16 refuses a bitsandbytes 8-bit policy with colocated vLLM ('vLLM does not "
                "support in-flight 8-bit quantization.'): use --quantization 4bit or vllm_mode=server"
            )
        kv_left = budget - weights - VLLM_RUNTIME_GIB
        if kv_left * GIB < kv_bytes_per_token(model) / tp * seq:
            problem = "vllm_kv"
            notes.append(
                f"vLLM's {budget:.1f} GiB leave {max(kv_left, 0):.1f} GiB of KV cache after "
                f"{weights:.1f} GiB of weights: not one {seq}-token sequence fits"
            )
        if static + budget > capacity_gib:
            problem = problem or "vllm_startup"
            notes.append(
                f"vLLM wants {budget:.1f} GiB but the trainer leaves {capacity_gib - static:.1f} GiB free"
            )
        if params.get("vllm_enable_sleep_mode"):
            vllm = VLLM_SLEEP_LEFTOVER_GIB
            # generation still needs the whole budget beside the trainer's static memory
            gen_peak = static + budget
            gen_features = {
                "model_states": parts["model_states"] + parts["reference"],
                "activations": 0.0,
                "logits": 0.0,
                "vllm": budget,
                "overhead": parts["overhead"],
            }
        else:
            vllm = budget
    parts["vllm"] = vllm
    train_peak = sum(parts.values())
    if gen_peak > train_peak:  # the generation phase sets the peak
        features, phase = gen_features, "generation"
    else:
        features = {
            "model_states": parts["model_states"] + parts["reference"],
            "activations": parts["activations"] + parts.get("vision", 0.0),
            "logits": parts["logits"],
            "vllm": parts["vllm"],
            "overhead": parts["overhead"],
        }
        phase = "training"
    total = max(train_peak, gen_peak)
    fits = total <= capacity_gib and problem is None
    return Estimate(
        model_states_gib=parts["model_states"],
        activations_gib=parts["activations"],
        logits_gib=parts["logits"],
        reference_gib=parts["reference"],
        vllm_gib=parts["vllm"],
        overhead_gib=parts["overhead"],
        total_gib=total,
        capacity_gib=capacity_gib,
        fits=fits,
        host_gib=host_states / GIB,
        generation_gib=generation,
        generation_sequences=sequences,
        phase=phase,
        vllm_problem=problem,
        notes=notes,
        features=features,
        vision_gib=parts.get("vision", 0.0),
        quantization=quant.label if quant else None,
    )


def _base_notes(
    model: ModelSpec,
    quant: Quantization | None,
    lora_rank: int | None,
    micro_batch: int,
    image_tokens: int,
    images: int,
    vision: float,
) -> list[str]:
    """What ``estimate`` says about a quantized base and a vision tower, beside the parts."""
    notes = []
    if quant is not None:
        adapters = lora_params(model, lora_rank or 0)
        notes.append(
            f"base weights {quant.label}: {weight_bytes(model, quant) / GIB:.1f} GiB for "
            f"{model.num_params / 1e9:.2f}B parameters (bf16 would be {2 * model.num_params / GIB:.1f}), "
            f"dequantization workspace {dequant_workspace_bytes(model, quant) / GIB:.2f} GiB, "
            f"LoRA r{lora_rank} adapters + AdamW {8 * adapters / GIB:.2f} GiB"
        )
    if model.vision is not None:
        tower = model.vision
        if images:
            patches = micro_batch * images * tower.patches(image_tokens)
            notes.append(
                f"vision tower: {tower.num_params / 1e9:.2f}B parameters in the model states; {images} "
                f"image(s) x {image_tokens} tokens per prompt ({patches} patches per micro-batch), "
                f"{vision / GIB:.2f} GiB of encoder activations"
            )
        else:
            notes.append(
                f"vision tower: {tower.num_params / 1e9:.2f}B parameters counted; no images (pass "
                "--image-tokens N, e.g. 1024 for a 1024x1024 image at 28x28 pixels per token)"
            )
    return notes
