"""A memory model for GRPO training: predicted peak memory per GPU, as a sum of named parts.

Why a model at all: a trial costs minutes of GPU time, a prediction costs microseconds. The
planner uses this to skip candidates that cannot fit and to start the search near the memory
boundary; the search then corrects it with every measured peak and every OOM (``calibrate``).

The parts (GiB per GPU):
- model states: weights, gradients and Adam states, by ZeRO stage and offload. Stages 2 and 3 use
  DeepSpeed's own estimator formulas (``estimate_zero2/3_model_states_mem_needs``); stages 0/1 the
  ZeRO paper's mixed-precision Adam (16P and 4P + 12P/N). LoRA: frozen bf16 base weights, and
  states for the adapters only.
- activations: Korthikanti et al. 2022 (s*b*h*34 bytes per layer with FlashAttention; with full
  recomputation 2*s*b*h per layer plus one layer's full activations during backward), scaled for
  the SwiGLU MLP width.
- logits: the loss materialises micro_batch x completion x vocab logits, upcast to fp32 and kept
  with their log-softmax for backward: about 4.6x the bf16 tensor (2.9x in the no-grad log-prob
  pass, trl issue 3678). With Qwen's 152k vocabulary this is often the largest part.
- reference model when beta > 0 (bf16 weights, sharded under ZeRO-3).
- vLLM colocated: the engine takes its fraction of TOTAL memory; with sleep mode only a small
  leftover remains while training, but generation still needs the full fraction next to the
  trainer's model states.
- overhead: CUDA context, NCCL buffers, allocator slack.

It also states vLLM's start-up conditions: the fraction must fit in what the trainer leaves free,
and the KV cache left after vLLM's own weights must hold one prompt+completion sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.models import ModelSpec
from autotune.units import GIB

# Peak memory of the logits per bf16 logits tensor (micro_batch x completion x vocab x 2 bytes).
# The no-grad log-prob forward peaks at ~2.9x (trl #3678); the training forward keeps fp32 logits
# and their log-softmax for backward, ~4.6x (open-r1 #615: 46 GB saved by a fused loss at
# 16 x 2048 x 151936). The training pass is the larger one, so it sets the peak.
LOGITS_PEAK_FACTOR = 4.6
CUDA_CONTEXT_GIB = 0.8
NCCL_GIB = 0.5
VLLM_SLEEP_LEFTOVER_GIB = 0.6
VLLM_RUNTIME_GIB = 1.0         # activations, CUDA graphs and sampler buffers inside its budget
LORA_TARGETS_PER_LAYER = 7     # q, k, v, o, gate, up, down ("all-linear")


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
    host_gib: float = 0.0                 # offloaded states in host RAM (all GPUs of the node)
    vllm_problem: str | None = None       # 'vllm_kv' | 'vllm_startup' when vLLM cannot start
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
        return {"model_states": self.model_states_gib, "activations": self.activations_gib,
                "logits": self.logits_gib, "reference": self.reference_gib, "vllm": self.vllm_gib,
                "overhead": self.overhead_gib}


def zero_model_states_bytes(params: int, largest_layer: int, stage: int, offload: str,
                            n_gpus: int) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) for weights + gradients + Adam states of a full fine-tune.

    Stages 2 and 3 follow DeepSpeed's estimators (CPU side with their 1.5 buffer factor).
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
        return 4 * P + 12 * P / N, 0.0
    return 16 * P, 0.0


def lora_params(model: ModelSpec, rank: int) -> int:
    """Adapter parameters for rank-r LoRA on every linear layer of every block."""
    h, inter = model.hidden_size, model.intermediate_size
    q_out = model.num_heads * model.head_dim
    kv_out = model.num_kv_heads * model.head_dim
    shapes = [(h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, inter), (h, inter), (inter, h)]
    return model.num_layers * sum(rank * (i + o) for i, o in shapes)


def model_states(model: ModelSpec, params: dict[str, Any], n_gpus: int, lora_rank: int | None
                 ) -> tuple[float, float]:
    stage = int(params.get("zero_stage", 0))
    offload = str(params.get("offload", "none"))
    P, LL = model.num_params, model.largest_layer_params
    if lora_rank:
        A = lora_params(model, lora_rank)
        base = 2 * P / max(n_gpus, 1) + 4 * LL if stage == 3 else 2 * P
        if offload == "optimizer+params" and stage == 3:
            base = 4 * LL
        states_gpu, states_cpu = zero_model_states_bytes(A, 0, stage, offload, n_gpus)
        return base + states_gpu, states_cpu
    return zero_model_states_bytes(P, LL, stage, offload, n_gpus)


def activation_bytes(model: ModelSpec, micro_batch: int, seq: int, checkpointing: bool) -> float:
    h, L = model.hidden_size, model.num_layers
    mlp_scale = (10 + 24 * model.intermediate_size / (4 * h)) / 34   # Korthikanti assumes 4h MLP
    per_layer_full = seq * micro_batch * h * 34 * mlp_scale
    if checkpointing:
        return 2 * seq * micro_batch * h * L + per_layer_full
    return per_layer_full * L


def logits_bytes(model: ModelSpec, micro_batch: int, completion: int) -> float:
    return micro_batch * completion * model.vocab_size * 2 * LOGITS_PEAK_FACTOR


def kv_bytes_per_token(model: ModelSpec) -> float:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2


def estimate(model: ModelSpec, params: dict[str, Any], *, gpus: int, capacity_gib: float,
             max_prompt_length: int, max_completion_length: int, beta: float = 0.0,
             lora_rank: int | None = None, dp_gpus: int | None = None) -> Estimate:
    """Predict the peak memory per GPU of one GRPO candidate, part by part (the planner calibrates
    the parts to measured peaks through :attr:`Estimate.features`)."""
    n = dp_gpus or gpus
    b = int(params.get("per_device_train_batch_size", 8))
    seq = max_prompt_length + max_completion_length
    stage = int(params.get("zero_stage", 0))
    gpu_states, host_states = model_states(model, params, n, lora_rank)
    acts = activation_bytes(model, b, seq, bool(params.get("gradient_checkpointing", True)))
    logits = logits_bytes(model, b, max_completion_length)
    ref = 0.0
    if beta and not lora_rank:   # with LoRA the reference is the base model with adapters off
        ref = 2 * model.num_params / (n if stage == 3 else 1)
    overhead = (CUDA_CONTEXT_GIB + (NCCL_GIB if n > 1 else 0.0)) * GIB

    parts = {
        "model_states": gpu_states / GIB,
        "activations": acts / GIB,
        "logits": logits / GIB,
        "reference": ref / GIB,
        "overhead": overhead / GIB,
    }
    notes: list[str] = []
    vllm = 0.0
    problem = None
    use_vllm = bool(params.get("use_vllm", False))
    mode = params.get("vllm_mode", "colocate")
    if use_vllm and mode == "colocate":
        frac = float(params.get("vllm_gpu_memory_utilization", 0.3))
        tp = int(params.get("vllm_tensor_parallel_size", 1))
        budget = frac * capacity_gib
        weights = 2 * model.num_params / tp / GIB
        kv_left = budget - weights - VLLM_RUNTIME_GIB
        if kv_left * GIB < kv_bytes_per_token(model) / tp * seq:
            problem = "vllm_kv"
            notes.append(f"vLLM's {budget:.1f} GiB leave {max(kv_left, 0):.1f} GiB of KV cache after "
                         f"{weights:.1f} GiB of weights: not one {seq}-token sequence fits")
        static = parts["model_states"] + parts["reference"] + parts["overhead"]
        if static + budget > capacity_gib:
            problem = problem or "vllm_startup"
            notes.append(f"vLLM wants {budget:.1f} GiB but the trainer leaves "
                         f"{capacity_gib - static:.1f} GiB free")
        if params.get("vllm_enable_sleep_mode"):
            vllm = VLLM_SLEEP_LEFTOVER_GIB
            # generation still needs the whole budget beside the trainer's static memory
            gen_peak = static + budget
            gen_budget = budget
        else:
            vllm = budget
            gen_peak = 0.0
        parts["vllm"] = vllm
    else:
        gen_peak = 0.0
        parts["vllm"] = 0.0
    if gen_peak > sum(parts.values()):   # generation phase dominates: trainer statics + vLLM
        features = {"model_states": parts["model_states"] + parts["reference"], "activations": 0.0,
                    "logits": 0.0, "vllm": gen_budget, "overhead": parts["overhead"]}
    else:
        features = {"model_states": parts["model_states"] + parts["reference"],
                    "activations": parts["activations"], "logits": parts["logits"], "vllm": parts["vllm"],
                    "overhead": parts["overhead"]}
    total = max(sum(parts.values()), gen_peak)
    fits = total <= capacity_gib and problem is None
    return Estimate(
        model_states_gib=parts["model_states"],
        activations_gib=parts["activations"], logits_gib=parts["logits"],
        reference_gib=parts["reference"], vllm_gib=parts["vllm"], overhead_gib=parts["overhead"],
        total_gib=total, capacity_gib=capacity_gib, fits=fits, host_gib=host_states / GIB,
        vllm_problem=problem, notes=notes, features=features,
    )
