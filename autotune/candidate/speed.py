"""A coarse prior on GRPO step time, used only to decide which candidates to try first.

Why a prior: the first trials of a night should already be good ones. This is a roofline-style
guess from published hardware figures (dense bf16 TFLOP/s, HBM bandwidth, GPU link), not a
measurement; the search replaces it with measured throughput as soon as trials finish. Its job is
to order candidates sensibly (bigger generation batches amortise decoding, ZeRO-3 and offload
move bytes, checkpointing recomputes), not to predict seconds.
"""

from __future__ import annotations

import math
from typing import Any

from autotune.candidate.batch import trl_completions
from autotune.candidate.defaults import knob
from autotune.candidate.footprint import vllm_weight_bytes
from autotune.hardware import GpuType
from autotune.models import ModelSpec, Quantization
from autotune.units import GIB

MFU = 0.35  # model FLOP utilisation a GRPO training step typically reaches
DECODE_EFFICIENCY = 0.5  # fraction of HBM bandwidth a decode step achieves
PCIE_GBS = 20.0  # host <-> GPU for offload traffic


def step_time_prior(
    model: ModelSpec,
    params: dict[str, Any],
    gpu: GpuType,
    *,
    gpus: int,
    dp_gpus: int,
    prompt: int,
    completion: int,
    beta: float = 0.0,
    quant: Quantization | None = None,
) -> float:
    """Rough seconds per optimizer step for a candidate (``quant``: how the frozen base is stored,
    which sets what the colocated engine loads)."""
    P = float(model.num_params)
    gas = int(knob(params, "gradient_accumulation_steps"))
    completions = trl_completions(params, dp_gpus)
    seq = prompt + completion
    tokens = completions * seq

    flops = 6 * P * tokens * (4 / 3 if knob(params, "gradient_checkpointing") else 1.0)
    flops += 2 * P * tokens * (2 if beta else 1)  # old and reference log-probs
    train = flops / (dp_gpus * gpu.tflops_bf16 * 1e12 * MFU)

    stage = int(params.get("zero_stage", 0))
    link = gpu.interconnect_gbs * 1e9
    if dp_gpus > 1:
        if stage == 3:
            train += gas * 3 * 2 * P / link  # gather fwd + bwd, reduce-scatter
        else:
            train += gas * 2 * P / link  # gradient reduction
    offload = params.get("offload", "none")
    if offload in ("optimizer", "optimizer+params"):
        train += 16 * P / dp_gpus / (PCIE_GBS * 1e9) + 12 * P / dp_gpus / 2e10  # move + CPU Adam
    if offload == "optimizer+params":
        train += gas * 2 * 2 * P / dp_gpus / (PCIE_GBS * 1e9)

    generate = _generation_time(
        model,
        params,
        gpu,
        gpus=gpus,
        dp_gpus=dp_gpus,
        completions=completions,
        seq=seq,
        completion=completion,
        quant=quant,
    )
    return train + generate


def _generation_time(
    model: ModelSpec,
    params: dict[str, Any],
    gpu: GpuType,
    *,
    gpus: int,
    dp_gpus: int,
    completions: int,
    seq: int,
    completion: int,
    quant: Quantization | None = None,
) -> float:
    P = float(model.num_params)
    kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2
    if not knob(params, "use_vllm"):
        per_token = 2 * P / (gpu.bandwidth_tbs * 1e12 * DECODE_EFFICIENCY) * 3  # HF generate is slow
        per_gpu = math.ceil(completions / dp_gpus)
        waves = math.ceil(per_gpu / max(int(knob(params, "per_device_train_batch_size")), 1))
        return waves * completion * per_token
    tp = int(knob(params, "vllm_tensor_parallel_size"))
    engines = max(gpus // tp, 1)
    per_token = 2 * P / tp / (gpu.bandwidth_tbs * 1e12 * DECODE_EFFICIENCY) + (20e-6 if tp > 1 else 0)
    if knob(params, "vllm_mode") == "colocate":
        budget = float(knob(params, "vllm_gpu_memory_utilization")) * gpu.memory_gib * GIB
    else:
        budget = 0.9 * gpu.memory_gib * GIB
    # the engine's weights as the memory model counts them: a 4-bit policy's engine loads 4-bit. The
    # decode and wake-up times below keep bf16 bytes: what bitsandbytes' in-flight 4-bit does to
    # their time is not known here, while its size is (TRL's vllm_generation passes the quantization)
    kv_bytes = max(budget * tp - vllm_weight_bytes(model, quant, 1) - tp * GIB, kv_token * seq)
    concurrency = max(int(kv_bytes / (kv_token * seq)), 1)
    seqs = math.ceil(completions / engines)
    waves = math.ceil(seqs / min(concurrency, 256))
    wake = 0.0
    if params.get("vllm_enable_sleep_mode"):
        wake = 2 * (2 * P / tp) / (PCIE_GBS * 1e9)
    return waves * completion * per_token + wake


def throughput_prior(model: ModelSpec, params: dict[str, Any], gpu: GpuType, **kw: Any) -> float:
    """Completions per second implied by :func:`step_time_prior`."""
    completions = trl_completions(params, kw["dp_gpus"])
    return completions / step_time_prior(model, params, gpu, **kw)
