"""A coarse prior on GRPO step time, used only to decide which candidates to try first.

Why a prior: the first trials of a night should already be good ones. This is a roofline-style
guess from published hardware figures (dense bf16 TFLOP/s, HBM bandwidth, GPU link) and launch
floors measured once on one GPU, not a measurement of this machine; the search replaces it with
measured throughput as soon as trials finish. Its job is
to order candidates sensibly (bigger generation batches amortise decoding, ZeRO-3 and offload
move bytes, checkpointing recomputes), not to predict seconds.
"""

from __future__ import annotations

import math
from typing import Any

from autotune.candidate.batch import generation_batch_of, trl_completions
from autotune.candidate.defaults import knob
from autotune.candidate.footprint import vllm_weight_bytes
from autotune.hardware import GpuType
from autotune.models import ModelSpec, Quantization
from autotune.units import GIB

MFU = 0.35  # model FLOP utilisation a GRPO training step typically reaches
DECODE_EFFICIENCY = 0.5  # fraction of HBM bandwidth a decode step achieves
PCIE_GBS = 20.0  # host <-> GPU for offload traffic
# Floors of eager PyTorch, where the GPU waits on the host launching kernels, per decoder layer.
# Measured on an H200 (docs/gpu-validation.md, fourth lease: scripts/gpu_microbatch.py and three
# TRL trials): a forward + backward took 66-101 ms per micro-step up to 1024 tokens, for 0.5B (24
# layers), 1.5B and 7B (28) alike, ~1.8 times that with checkpointing; TRL's whole generation phase
# of 128 tokens at batch 32 (1.5B, 28 layers), prefill included, ~23 ms a token. They depend on the
# host and the framework more than on the card: the prior's guess, not the card's figure.
LAYER_LAUNCH_S = 3e-3  # forward + backward, per layer and micro-step
CHECKPOINT_LAUNCH = 1.8  # the same with gradient checkpointing's recompute
DECODE_LAUNCH_S = 0.8e-3  # one decode step of transformers' generate, per layer


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
    per_round: bool = False,
) -> float:
    """Rough seconds per optimizer step for a candidate (``quant``: how the frozen base is stored,
    which sets what the colocated engine loads; ``per_round``: see :func:`_generation_time`)."""
    P = float(model.num_params)
    gas = int(knob(params, "gradient_accumulation_steps"))
    completions = trl_completions(params, dp_gpus)
    seq = prompt + completion
    tokens = completions * seq

    checkpointing = bool(knob(params, "gradient_checkpointing"))
    passes = _log_prob_passes(params, gas, beta, per_round, dp_gpus)
    flops = 6 * P * tokens * (4 / 3 if checkpointing else 1.0) + 2 * P * tokens * passes
    # each micro-batch costs its FLOPs or the launch floor, whichever is longer: small micro-batches
    # leave the GPU waiting on the host (the forward-only log-prob passes a third of the floor each)
    floor = model.num_layers * LAYER_LAUNCH_S * ((CHECKPOINT_LAUNCH if checkpointing else 1.0) + passes / 3)
    train = gas * max(flops / (dp_gpus * gas * gpu.tflops_bf16 * 1e12 * MFU), floor)

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
        per_round=per_round,
    )
    return train + generate


def _log_prob_passes(params: dict[str, Any], gas: int, beta: float, per_round: bool, dp_gpus: int) -> int:
    """Forward-only passes beside the training one: the reference model's when beta > 0, and the
    old policy's. TRL 1.16 (``per_round``) computes the old log-probs only with vLLM or when a
    generation round does not line up with the optimizer step (gas % (steps_per_generation x
    num_iterations), the round as ``generation_batch_of`` derives it, whichever name the space
    sets); a trainer the prior cannot read is charged one, as before."""
    old = 1
    if per_round:
        batch = generation_batch_of(params, dp_gpus)[0]
        micro = int(knob(params, "per_device_train_batch_size")) * dp_gpus
        every = (batch // micro if batch else gas) * int(params.get("num_iterations") or 1)
        old = int(bool(knob(params, "use_vllm")) or gas % max(every, 1) != 0)
    return old + (1 if beta else 0)


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
    per_round: bool = False,
) -> float:
    """Seconds of one optimizer step's generation.

    Without vLLM, ``per_round`` says how transformers' generate is called: TRL calls it once per
    generation round on all of the round's prompts on the device (bs x steps_per_generation; its
    source and an H200's trials, docs/gpu-validation.md, fourth lease), so the micro-batch does not
    move it. For a trainer whose code the prior does not know (``--command``, ms-swift's engine)
    it stays in waves of the training micro-batch, as a rollout loop that chunks by it would run:
    that steep rise with the micro-batch stands in for the micro-batch efficiency such trainers
    show, and the measured launch floor alone (in :func:`step_time_prior`) is far flatter than
    theirs on the benchmark (docs/benchmarks-notes.md, twenty-first pass).
    """
    P = float(model.num_params)
    kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2
    if not knob(params, "use_vllm") and per_round:
        # a decode step is bound by the host's launches, the weights' bytes or the batch's FLOPs
        batch = generation_batch_of(params, dp_gpus)[0] or completions
        per_call = max(math.ceil(batch / dp_gpus), 1)
        per_token = max(
            model.num_layers * DECODE_LAUNCH_S,
            2 * P / (gpu.bandwidth_tbs * 1e12 * DECODE_EFFICIENCY),
            2 * P * per_call / (gpu.tflops_bf16 * 1e12 * MFU),
        )
        prefill = 2 * P * per_call * (seq - completion) / (gpu.tflops_bf16 * 1e12 * MFU)
        rounds = completions / dp_gpus / per_call / int(params.get("num_iterations") or 1)
        return rounds * (completion * per_token + prefill)
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
