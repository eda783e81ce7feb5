"""Where the simulated GRPO trainer's GPU and host memory goes: the landscape's memory terms.

Each function computes one part of the story (model states, one micro-batch, the vLLM engine, the
host) from the scenario and writes its figures into ``info`` for the logs and error texts. Every
term is scaled by the landscape's physics (``Physics``), so benchmark landscapes differ.

Calibrated on the H100 measurements of docs/gpu-validation.md (Qwen2.5-1.5B, one GPU): ZeRO 1 and
2 keep fp32 master weights and fp32 gradient partitions beside the bf16 model, which one GPU cannot
shard away (66.1 GiB against 49.5 for ZeRO 0 at the same batch), and ZeRO 3 with parameter offload
keeps prefetch buffers and gathered layers on the GPU (42.0 GiB).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from autotune.sim.scenario import Scenario
from autotune.units import GIB


@dataclass
class Footprint:
    """Memory terms in bytes (per training GPU unless named otherwise)."""

    n: int  # data-parallel training GPUs
    P: float  # parameters
    A: float  # trainable parameters
    lora: bool
    ref: bool
    states: float = 0.0
    ctx: float = 0.0
    rank0_extra: float = 0.0
    acts: float = 0.0
    logits: float = 0.0
    frag: float = 1.0
    dyn: float = 0.0
    # vLLM
    budget: float = 0.0
    w_vllm: float = 0.0
    kv_mem: float = 0.0
    kvb_gpu: float = 0.0
    conc: int = 0
    vllm_train: float = 0.0
    vllm_gen: float = 0.0
    vllm_outside: float = 0.15 * GIB
    # host
    host_init: float = 0.0
    host_step1: float = 0.0
    host_limit: float = 0.0


def base_bytes_per_param(sc: Scenario) -> float:
    """Bytes one frozen base parameter takes: bf16, or NF4 / int8 codes with their scales."""
    return {4: 0.56, 8: 1.06}.get(sc.quant_bits, 2.0)


def model_states(sc: Scenario, fp: Footprint, rng: random.Random, info: dict[str, Any]) -> None:
    """Weights, gradients, optimizer states, buckets and the reference model on one GPU."""
    k, m, ph = sc.k, sc.m, sc.physics
    P, A, n = fp.P, fp.A, fp.n
    z3 = k.zero == 3
    wb = base_bytes_per_param(sc) if fp.lora else 2.0
    weights = (0.0 if k.offload_params else wb * P / n) if z3 else wb * P
    if fp.lora:  # only the adapters train: tiny states
        grads_opt = 16.0 * A / (n if z3 else 1)
    elif k.offload_opt:
        grads_opt = (0.5 * 2.0 * A / n) if z3 else (0.25 * 2.0 * A / n)  # staging for the CPU copy
    elif k.zero == 0:
        grads_opt = 6.0 * A  # DeepSpeed's bf16 optimizer with ZeRO off (measured ~8 bytes/param)
    elif k.zero in (1, 2):
        # bf16 grads, and fp32 master, m, v and the fp32 gradient partition, sharded (measured)
        grads_opt = 2.0 * A + 14.0 * A / n
    else:
        grads_opt = 14.0 * A / n
    if z3:
        live = 2.0 * (m.largest_module + 2.0 * m.layer_linear) * (1.15 if k.offload_params else 1.0)
        buffers = live + 2.0 * 0.9 * m.hidden**2 * 2
    else:
        buffers = 2.0 * 2.0 * min(5e8, max(m.hidden**2, 2e7)) + (0.0 if k.zero else 2.0 * A * 0.04)
    if fp.ref and z3:
        ref_w = 0.0 if k.offload_params else 2.0 * P / n
    else:
        ref_w = 2.0 * P if fp.ref else 0.0
    dequant = 4.0 * m.largest_module if sc.quant_bits < 16 else 0.0  # bf16 workspace of one matrix
    fp.states = (weights + grads_opt + buffers + ref_w + dequant) * 1.012 * ph.mem_states
    # non-PyTorch memory: CUDA context, NCCL communicators, cuBLAS workspaces (hidden)
    ctx = (0.52 if sc.gpu.tflops >= 700 else 0.44) * GIB
    if sc.gpus > 1:
        ctx += (0.21 + 0.043 * sc.gpus) * GIB
    if k.zero >= 1:
        ctx += 0.11 * GIB
    fp.ctx = ctx * ph.mem_ctx
    fp.rank0_extra = (0.27 * GIB + rng.uniform(0.0, 0.1) * GIB) * ph.mem_ctx
    info["states_gib"] = fp.states / GIB


def micro_batch(sc: Scenario, fp: Footprint, rng: random.Random, info: dict[str, Any]) -> None:
    """Activations, logits and fragmentation of one micro-batch (and a vision tower's patches)."""
    k, m, ph = sc.k, sc.m, sc.physics
    b, C, h = k.pdbs, sc.completion, m.hidden
    s_len = sc.prompt + sc.completion
    kvd = m.kv_heads * m.head_dim
    layer_tok = 2.0 * (7 * h + 2 * kvd + 4 * m.inter) + 4.0 * m.heads  # stored per token per layer
    if k.gc:
        acts = m.layers * s_len * b * h * 2.0 + s_len * b * layer_tok * 1.0
    else:
        acts = m.layers * s_len * b * layer_tok
    if m.vision_depth and sc.image_tokens:
        patches = 4 * sc.image_tokens  # 2 x 2 patches merge into one LLM token
        per_block = 34.0 * m.vision_hidden * 2.0
        acts += b * patches * per_block * (2 if k.gc else m.vision_depth)
    if k.liger:
        logits = 2.0 * b * C * h * 4.0 + min(b * C, 1024) * m.vocab * 4.0 * 2.0
    else:
        logits = 5.8 * b * C * m.vocab  # fp32 upcast of bf16 logits, ~2.9x the bf16 tensor
    fp.acts, fp.logits = acts * ph.mem_acts, logits * ph.mem_logits
    fp.frag = 1.03 + 0.022 * math.log2(b) + (0.025 if not k.gc else 0.0) + rng.uniform(-0.006, 0.006)
    fp.dyn = (fp.acts + fp.logits) * fp.frag
    info.update(logits_gib=fp.logits / GIB, acts_gib=fp.acts / GIB, dyn_gib=fp.dyn / GIB)


def vllm_engine(sc: Scenario, fp: Footprint, rng: random.Random, info: dict[str, Any]) -> None:
    """The engine's budget, weights, KV cache and concurrency; what stays while training."""
    k, m, ph = sc.k, sc.m, sc.physics
    s_len = sc.prompt + sc.completion
    fp.kvb_gpu = m.kv_bytes_per_token / min(k.tp, m.kv_heads)  # KV heads shard across TP ranks
    fp.w_vllm = (base_bytes_per_param(sc) if fp.lora else 2.0) * fp.P / k.tp
    if not k.use_vllm:
        return
    # TRL sizes the colocated engine for exactly one generation batch; vllm-serve keeps vLLM's 256
    max_num_seqs = 256 if k.server else k.pdbs * k.tp * k.spg
    batched_tokens = 8192 if k.server else 4096
    cap = sc.gpu.mem * GIB
    fp.budget = k.util * cap
    act_peak = (
        batched_tokens * (2 * m.inter + 4 * m.hidden) * 2.0 / k.tp
        + min(max_num_seqs, batched_tokens) * m.vocab * 4.0
    ) * 1.1
    graphs = rng.uniform(0.25, 0.6) * GIB
    fp.kv_mem = fp.budget - fp.w_vllm - (act_peak + graphs) * ph.mem_engine
    info.update(
        vllm_budget_gib=fp.budget / GIB,
        vllm_weights_gib=fp.w_vllm / GIB,
        kv_cache_gib=max(fp.kv_mem, 0.0) / GIB,
        kv_avail_gib=fp.kv_mem / GIB,
        graphs_gib=graphs / GIB,
        max_model_len=sc.max_model_len,
    )
    kv_tokens = 0
    if fp.kv_mem > 0:
        kv_tokens = int(fp.kv_mem // (16 * fp.kvb_gpu)) * 16
        info.update(gpu_blocks=kv_tokens // 16, kv_tokens=kv_tokens)
        info["max_concurrency"] = kv_tokens / sc.max_model_len
    fp.conc = min(max_num_seqs, int(kv_tokens // s_len))
    info["concurrency"] = fp.conc
    if not k.server:
        fp.vllm_gen = fp.budget + fp.vllm_outside
        # TRL puts the engine to sleep at level 2: weights and KV cache are unmapped while the
        # trainer works; the CUDA-graph pool and a little more stay.
        fp.vllm_train = (graphs + 0.3 * GIB + fp.vllm_outside) if k.sleep else fp.vllm_gen


def host_memory(sc: Scenario, fp: Footprint, info: dict[str, Any]) -> None:
    """Host RAM at start-up and after DeepSpeed's CPUAdam made its moments (step 1)."""
    k, P, A = sc.k, fp.P, fp.A
    host_base = sc.gpus * (2.8 + (1.2 if k.use_vllm and not k.server else 0.0)) * GIB + 1.5 * GIB
    if k.server:
        host_base += 3.5 * GIB
    fp.host_init = fp.host_step1 = host_base
    if k.offload_opt:
        fp.host_init += (4.0 * A + 4.0 * A) * 1.06 + sc.gpus * 0.5 * GIB  # fp32 master + grads, pinned
        fp.host_step1 = fp.host_init + 8.0 * A * 1.02  # Adam m and v
    if k.offload_params:
        extra = 2.0 * P * 1.1 + (2.0 * P * 1.1 if fp.ref else 0.0)
        fp.host_init += extra
        fp.host_step1 += extra
    fp.host_limit = sc.host_gib * GIB * 0.94 - 3.0 * GIB
    info.update(
        host_init_gib=fp.host_init / GIB,
        host_need_gib=fp.host_step1 / GIB,
        host_limit_gib=fp.host_limit / GIB,
    )
