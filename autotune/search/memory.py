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
ZERO3_MAX_LIVE_PARAMS = 1e9    # stage3_max_live_parameters in configs/deepspeed.py
GEN_LOGITS_FACTOR = 3.0        # fp32 last-token logits, their softmax and the sampled copy
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
    host_gib: float = 0.0                 # offloaded states in host RAM (all GPUs of the node)
    generation_gib: float = 0.0           # HF generate() without vLLM: KV cache + prefill + sampling
    generation_sequences: int = 0         # sequences in that one generate() call per GPU
    phase: str = "training"               # which phase sets the peak: training | generation
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


def layer_activation_bytes_per_token(model: ModelSpec) -> float:
    """Bytes autograd saves per token in one decoder layer (bf16, SDPA, no dropout)."""
    h = model.hidden_size
    return 22 * h + 4 * model.num_kv_heads * model.head_dim + 8 * model.intermediate_size


def activation_bytes(model: ModelSpec, micro_batch: int, seq: int, checkpointing: bool) -> tuple[float, float]:
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
    if stage == 3 and not lora_rank:   # parameters ZeRO-3 keeps gathered between uses
        gpu_states += 2 * min(model.num_params, ZERO3_MAX_LIVE_PARAMS)
    kept, recompute = activation_bytes(model, b, seq, bool(params.get("gradient_checkpointing", True)))
    logits = logits_bytes(model, b, max_completion_length)
    # with recomputation one layer's activations come back only after the logits are freed
    acts = kept + max(recompute - logits, 0.0)
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
    static = parts["model_states"] + parts["reference"] + parts["overhead"]
    notes: list[str] = []
    vllm = 0.0
    problem = None
    gen_peak, gen_features = 0.0, {}
    use_vllm = bool(params.get("use_vllm", False))
    mode = params.get("vllm_mode", "colocate")
    sequences = generation_sequences(params, n)
    generation = 0.0
    if sequences:   # transformers' generate() in the trainer's process
        kv = kv_bytes_per_token(model) * seq * sequences / GIB
        generation = generation_bytes(model, sequences, max_prompt_length, max_completion_length) / GIB
        sampling = sequences * model.vocab_size * 4 * GEN_LOGITS_FACTOR / GIB
        gathered = 2 * model.num_params / GIB if stage == 3 else 0.0   # ds3_gather_for_generation
        gen_peak = static + gathered + generation
        gen_features = {"model_states": parts["model_states"] + parts["reference"] + gathered,
                        "activations": generation - sampling, "logits": sampling, "vllm": 0.0,
                        "overhead": parts["overhead"]}
        notes.append(f"generation without vLLM: one generate() over {sequences} sequences x {seq} tokens "
                     f"per GPU, {kv:.1f} GiB of KV cache, {generation:.1f} GiB in all")
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
        if static + budget > capacity_gib:
            problem = problem or "vllm_startup"
            notes.append(f"vLLM wants {budget:.1f} GiB but the trainer leaves "
                         f"{capacity_gib - static:.1f} GiB free")
        if params.get("vllm_enable_sleep_mode"):
            vllm = VLLM_SLEEP_LEFTOVER_GIB
            # generation still needs the whole budget beside the trainer's static memory
            gen_peak = static + budget
            gen_features = {"model_states": parts["model_states"] + parts["reference"], "activations": 0.0,
                            "logits": 0.0, "vllm": budget, "overhead": parts["overhead"]}
        else:
            vllm = budget
    parts["vllm"] = vllm
    train_peak = sum(parts.values())
    if gen_peak > train_peak:   # the generation phase sets the peak
        features, phase = gen_features, "generation"
    else:
        features = {"model_states": parts["model_states"] + parts["reference"],
                    "activations": parts["activations"], "logits": parts["logits"], "vllm": parts["vllm"],
                    "overhead": parts["overhead"]}
        phase = "training"
    total = max(train_peak, gen_peak)
    fits = total <= capacity_gib and problem is None
    return Estimate(
        model_states_gib=parts["model_states"],
        activations_gib=parts["activations"], logits_gib=parts["logits"],
        reference_gib=parts["reference"], vllm_gib=parts["vllm"], overhead_gib=parts["overhead"],
        total_gib=total, capacity_gib=capacity_gib, fits=fits, host_gib=host_states / GIB,
        generation_gib=generation, generation_sequences=sequences, phase=phase,
        vllm_problem=problem, notes=notes, features=features,
    )
