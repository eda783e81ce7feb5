"""A memory model for GRPO training: predicted peak memory per GPU, as a sum of named parts.

Why a model at all: a trial costs minutes of GPU time, a prediction costs microseconds. The
planner uses this to skip candidates that cannot fit and to start the search near the memory
boundary; the search then corrects it with every measured peak and every OOM (``calibrate``).

The parts and what each counts: :mod:`autotune.candidate.footprint`. Here they are added up per
phase: training (every part) and generation (HF ``generate()`` or colocated vLLM beside the
trainer's static memory); the peak is the larger phase.

It also states vLLM's start-up conditions: the fraction must fit in what the trainer leaves free,
and the KV cache left after vLLM's own weights must hold one prompt+completion sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.candidate.batch import generation_sequences
from autotune.candidate.defaults import knob
from autotune.candidate.footprint import (
    GEN_LOGITS_FACTOR,
    activation_bytes,
    base_quantization,
    dequant_workspace_bytes,
    generation_bytes,
    kv_bytes_per_token,
    logits_bytes,
    lora_params,
    model_states,
    vision_activation_bytes,
    vllm_weight_bytes,
    weight_bytes,
)
from autotune.errors import UsageError
from autotune.models import ModelSpec, Quantization
from autotune.units import GIB

CUDA_CONTEXT_GIB = 0.8
NCCL_GIB = 0.5
VLLM_SLEEP_LEFTOVER_GIB = 0.6
VLLM_RUNTIME_GIB = 1.0  # activations, CUDA graphs and sampler buffers inside its budget
ZERO3_MAX_LIVE_PARAMS = 1e9  # stage3_max_live_parameters in configs/deepspeed.py
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


@dataclass
class _Generation:
    """The generation phase's peak (GiB) and the parts it is made of (empty: no such phase)."""

    peak: float = 0.0
    features: dict[str, float] = field(default_factory=dict)


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
    text-only model. Callers with a recipe use :func:`autotune.candidate.estimate.estimate_for`.
    """
    n = dp_gpus or gpus
    b = int(knob(params, "per_device_train_batch_size"))
    if image_tokens and model.vision is None:
        raise UsageError(
            f"--image-tokens {image_tokens}: model {model.name!r} has no vision tower (a text-only "
            "config); drop --image-tokens or use a vision-language model such as Qwen2.5-VL-3B"
        )
    images = int(images_per_prompt) if image_tokens else 0
    prompt = int(max_prompt_length) + int(image_tokens) * images
    seq = prompt + max_completion_length
    quant = base_quantization(model, quantization, lora_rank)
    parts, host_states, vision = _training_parts(
        model, params, n, b, seq, max_completion_length, beta, lora_rank, quant, image_tokens, images
    )
    static = parts["model_states"] + parts["reference"] + parts["overhead"]
    notes = _base_notes(model, quant, lora_rank, b, image_tokens, images, vision)
    sequences = generation_sequences(params, n)
    generation, phase_gen = 0.0, _Generation()
    if sequences:  # transformers' generate() in the trainer's process
        generation, phase_gen = _hf_generation(
            model, params, parts, static, sequences, prompt, max_completion_length, notes
        )
    vllm, problem = 0.0, None
    if bool(knob(params, "use_vllm")) and knob(params, "vllm_mode") == "colocate":
        vllm, problem, sleeping = _colocated_vllm(
            model, params, quant, capacity_gib, parts, static, seq, notes
        )
        phase_gen = sleeping or phase_gen
    parts["vllm"] = vllm
    train_peak = sum(parts.values())
    if phase_gen.peak > train_peak:  # the generation phase sets the peak
        features, phase = phase_gen.features, "generation"
    else:
        features = {
            "model_states": parts["model_states"] + parts["reference"],
            "activations": parts["activations"] + parts.get("vision", 0.0),
            "logits": parts["logits"],
            "vllm": parts["vllm"],
            "overhead": parts["overhead"],
        }
        phase = "training"
    total = max(train_peak, phase_gen.peak)
    return Estimate(
        model_states_gib=parts["model_states"],
        activations_gib=parts["activations"],
        logits_gib=parts["logits"],
        reference_gib=parts["reference"],
        vllm_gib=parts["vllm"],
        overhead_gib=parts["overhead"],
        total_gib=total,
        capacity_gib=capacity_gib,
        fits=total <= capacity_gib and problem is None,
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


def _training_parts(
    model: ModelSpec,
    params: dict[str, Any],
    n: int,
    b: int,
    seq: int,
    completion: int,
    beta: float,
    lora_rank: int | None,
    quant: Quantization | None,
    image_tokens: int,
    images: int,
) -> tuple[dict[str, float], float, float]:
    """The training phase's parts in GiB (vLLM's is added later), the host bytes of offloaded
    states and the vision encoder's activation bytes."""
    stage = int(params.get("zero_stage", 0))
    gpu_states, host_states = model_states(model, params, n, lora_rank, quant)
    if stage == 3 and not lora_rank:  # parameters ZeRO-3 keeps gathered between uses
        gpu_states += 2 * min(model.num_params, ZERO3_MAX_LIVE_PARAMS)
    checkpointing = bool(knob(params, "gradient_checkpointing"))
    kept, recompute = activation_bytes(model, b, seq, checkpointing)
    logits = logits_bytes(model, b, completion)
    # with recomputation one layer's activations come back only after the logits are freed
    acts = kept + max(recompute - logits, 0.0)
    ref = 0.0
    if beta and not lora_rank:  # with LoRA the reference is the base model with adapters off
        ref = 2 * model.num_params / (n if stage == 3 else 1)
    overhead = (CUDA_CONTEXT_GIB + (NCCL_GIB if n > 1 else 0.0)) * GIB
    vision = vision_activation_bytes(model, b, image_tokens, images, checkpointing)
    parts = {
        "model_states": gpu_states / GIB,
        "activations": acts / GIB,
        "logits": logits / GIB,
        "reference": ref / GIB,
        "overhead": overhead / GIB,
    }
    if vision:
        parts["vision"] = vision / GIB
    return parts, host_states, vision


def _hf_generation(
    model: ModelSpec,
    params: dict[str, Any],
    parts: dict[str, float],
    static: float,
    sequences: int,
    prompt: int,
    completion: int,
    notes: list[str],
) -> tuple[float, _Generation]:
    """transformers' ``generate()`` over ``sequences`` beside the trainer's static memory: its GiB
    and the phase it makes (ZeRO-3 gathers the full bf16 weights for it)."""
    seq = prompt + completion
    kv = kv_bytes_per_token(model) * seq * sequences / GIB
    generation = generation_bytes(model, sequences, prompt, completion) / GIB
    sampling = sequences * model.vocab_size * 4 * GEN_LOGITS_FACTOR / GIB
    stage = int(params.get("zero_stage", 0))
    gathered = 2 * model.num_params / GIB if stage == 3 else 0.0  # ds3_gather_for_generation
    notes.append(
        f"generation without vLLM: one generate() over {sequences} sequences x {seq} tokens "
        f"per GPU, {kv:.1f} GiB of KV cache, {generation:.1f} GiB in all"
    )
    features = {
        "model_states": parts["model_states"] + parts["reference"] + gathered,
        "activations": generation - sampling,
        "logits": sampling,
        "vllm": 0.0,
        "overhead": parts["overhead"],
    }
    return generation, _Generation(static + gathered + generation, features)


def _colocated_vllm(
    model: ModelSpec,
    params: dict[str, Any],
    quant: Quantization | None,
    capacity_gib: float,
    parts: dict[str, float],
    static: float,
    seq: int,
    notes: list[str],
) -> tuple[float, str | None, _Generation | None]:
    """vLLM in the trainer's GPUs: what it holds while training (GiB), why it cannot start (None
    when it can), and with sleep mode the generation phase it makes (its whole budget beside the
    trainer's static memory; None without sleep mode, where the budget is held throughout)."""
    frac = float(knob(params, "vllm_gpu_memory_utilization"))
    tp = int(knob(params, "vllm_tensor_parallel_size"))
    budget = frac * capacity_gib
    weights = vllm_weight_bytes(model, quant, tp) / GIB
    problem = None
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
    if not params.get("vllm_enable_sleep_mode"):
        return budget, problem, None
    features = {
        "model_states": parts["model_states"] + parts["reference"],
        "activations": 0.0,
        "logits": 0.0,
        "vllm": budget,
        "overhead": parts["overhead"],
    }
    return VLLM_SLEEP_LEFTOVER_GIB, problem, _Generation(static + budget, features)


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
