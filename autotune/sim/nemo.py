"""A NeMo-RL-style GRPO trainer, held out: a Megatron-Core policy colocated with vLLM, in NeMo-RL's names.

Written after the search had been shaped on the report's families and after ``verl``, with functional
forms none of them has, each resting on NeMo-RL's or Megatron-LM's own code and docs:

- The policy is split three ways, ``gpus = tensor_model_parallel_size x pipeline_model_parallel_size x
  DP``. Tensor parallelism shards the weights, the vocab-parallel logits and most of a layer's
  activations, and costs four all-reduces per layer and micro-batch (six under full recomputation),
  cheap over NVLink and dear over PCIe; without ``sequence_parallel`` the layer norms' and dropouts'
  activations stay whole on every TP rank (Korthikanti et al. 2022). Pipeline parallelism splits the
  layers into stages: the 1F1B schedule idles (p-1)/(m+p-1) of a pass of m micro-batches, and the first
  stage holds the activations of up to p micro-batches in flight, so it saves weights, not activations.
- Megatron's distributed optimizer keeps 6 + 12/DP bytes a parameter (bf16 weights, fp32 gradients, fp32
  master and Adam's moments sharded over the data-parallel ranks only): the optimizer's part is the same
  whatever TP and PP are. ``optimizer_cpu_offload`` (HybridDeviceOptimizer) moves the moments to the host
  (6 + 4/DP) and steps Adam on the CPU: a cost, but it spares the optimizer's trip to the host and back
  that a colocated step otherwise makes, so on some machines it is also faster.
- ``activation_checkpointing`` with ``recompute_granularity``: ``selective`` recomputes core attention (a
  few per cent of the time, the attention scores' memory), ``full`` keeps only each layer's input and
  redoes the forward (a third more compute); the granularity does nothing without the checkpointing.
- Colocation: vLLM starts first on an empty card and sleeps; the policy then loads. Before each
  rollout the policy's weights, gradients and optimizer go to the host, so ``gpu_memory_utilization``
  competes with no training state: too little leaves no KV cache, too much is refused at start-up,
  and between them a larger share shortens the rollout by fewer waves, until one wave holds every
  sequence. Each step pays the trips to the host (the less of the model a GPU holds, the shorter),
  the reference model's weights swapped in and out, and the refit.
- Sequence packing is on (NeMo-RL's Megatron default): no padding is computed, and the packed
  micro-batches are fewer than the sequences, which widens the pipeline's bubble.
- The run is refused at start-up, in NeMo-RL's and Megatron's words, where TP x PP exceeds the GPUs,
  where ``sequence_parallel`` has no tensor parallelism, or where TP does not divide the heads.
"""

from __future__ import annotations

import math
import random
from typing import Any

from autotune.sim.family_base import Env, Plan, dies_at_start, play, trial_rng
from autotune.sim.truth import TrialTruth, oom_numbers
from autotune.units import GIB

SPACE = "nemo.yaml"
PROGRAM = "/opt/nemo-rl/examples/run_grpo.py"
HOST_BW = 12e9  # bytes/s host <-> GPU as a pinned copy reaches it (before the landscape's factor)
REFIT_CHUNK_S = 0.04  # seconds of each refit chunk's IPC handshake


def template(vllm_tp: int, total_length: int) -> str:
    """The ``--command`` template: NeMo-RL's GRPO entry point with its overrides; the engine's tensor
    parallelism and the sequence length are the recipe's, not searched (``train_global_batch_size`` is
    completions per step in NeMo-RL as in autotune)."""
    return (
        "python3 examples/run_grpo.py --config examples/configs/grpo_math_1B_megatron.yaml "
        "policy.model_name={model} cluster.gpus_per_node={gpus} "
        "policy.train_global_batch_size={global_batch} "
        "policy.train_micro_batch_size={train_micro_batch_size} "
        "policy.logprob_batch_size={logprob_batch_size} "
        f"policy.max_total_sequence_length={total_length} "
        "policy.generation.max_new_tokens={max_completion_length} "
        "policy.megatron_cfg.tensor_model_parallel_size={tensor_model_parallel_size} "
        "policy.megatron_cfg.pipeline_model_parallel_size={pipeline_model_parallel_size} "
        "policy.megatron_cfg.sequence_parallel={sequence_parallel} "
        "policy.megatron_cfg.activation_checkpointing={activation_checkpointing} "
        "policy.megatron_cfg.recompute_granularity={recompute_granularity} "
        "policy.megatron_cfg.optimizer.optimizer_cpu_offload={optimizer_cpu_offload} "
        "policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.0 "
        f"policy.generation.vllm_cfg.tensor_parallel_size={vllm_tp} "
        "policy.generation.vllm_cfg.gpu_memory_utilization={gpu_memory_utilization} "
        "grpo.max_num_steps={max_steps} checkpointing.checkpoint_dir={trial_dir}"
    )


def layout(env: Env, p: dict[str, Any]) -> tuple[int, int, int]:
    """(TP, PP, DP) of the policy; DP is 0 where TP x PP exceeds the GPUs."""
    tp, pp = int(p["tensor_model_parallel_size"]), int(p["pipeline_model_parallel_size"])
    return tp, pp, env.gpus // (tp * pp)


def refusal(env: Env, p: dict[str, Any]) -> str | None:
    """Why NeMo-RL (world size) or Megatron-Core (its config's checks) refuses the layout, or None."""
    tp, pp, _ = layout(env, p)
    need, gpus = tp * pp, env.gpus
    if need > gpus:
        return (
            f"World size ({gpus}) is insufficient for the parallelism configuration. Required minimum "
            f"world size: PP({pp}) * CP(1) * TP({tp}) = {need}. This would result in DP = {gpus}/{need} = "
            f"{gpus / need:.3f}, but DP must be \u2265 1. Please either increase the number of GPUs/nodes "
            "or reduce the parallelism parameters."
        )
    if gpus % need:
        return (
            f"World size ({gpus}) must be divisible by PP * CP * TP ({need}). The data parallel size "
            "(DP = world_size / (PP * CP * TP)) must be a positive integer."
        )
    if p["sequence_parallel"] and tp == 1:
        return "Cannot use sequence parallelism without tensor parallelism"
    heads = int(env.extra["heads"])
    if heads % tp:
        return f"num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp})."
    return None


def stage_params(env: Env, tp: int, pp: int) -> float:
    """Parameters on one GPU of the heaviest stage: its share of the layers and one vocab-parallel
    embedding (the first stage's input embedding, the last stage's output layer; one stage has both)."""
    emb = env.vocab * env.hidden
    body = env.params_b * 1e9 - env.extra["embeddings"] * emb
    return (body / pp + emb * (env.extra["embeddings"] if pp == 1 else 1)) / tp


def states(env: Env, p: dict[str, Any]) -> float:
    """Bytes per GPU of the policy's states while it trains: Megatron's distributed optimizer,
    6 + 12/DP a parameter (bf16 weights, fp32 gradients; fp32 master and two moments over DP), or
    6 + 4/DP with the moments on the host (``optimizer_cpu_offload``)."""
    tp, pp, dp = layout(env, p)
    sharded = 4.0 if p["optimizer_cpu_offload"] else 12.0
    return stage_params(env, tp, pp) * (6.0 + sharded / dp) * env.physics.mem_states


def layer_bytes(env: Env, p: dict[str, Any], tokens: float, *, kept: bool = True) -> float:
    """Bytes one layer keeps for the backward of ``tokens`` (Korthikanti et al.: sbh(10 + 24/t +
    5as/(ht)) without sequence parallelism, sbh(34 + 5as/h)/t with it); ``kept=False``: as if nothing
    were recomputed (the layer being recomputed)."""
    tp = int(p["tensor_model_parallel_size"])
    sp = bool(p["sequence_parallel"]) and tp > 1
    seq = env.prompt + env.completion
    attention = 5.0 * env.extra["heads"] * seq / env.hidden * env.extra["attn_kept"]
    replicated = 10.0 / tp if sp else 10.0  # layer norms, dropout masks: whole on each rank without SP
    ckpt = p["activation_checkpointing"] and kept
    if not ckpt:
        per = replicated + (24.0 + attention) / tp
    elif p["recompute_granularity"] == "selective":
        per = replicated + 24.0 / tp
    else:
        per = 2.0 / tp if sp else 2.0  # the layer's input only
    return tokens * env.hidden * per * env.physics.mem_acts


def micro_batches(env: Env, p: dict[str, Any], size: int) -> int:
    """Micro-batches of one pass on a DP rank: packed sequences fill bins of ``size`` full lengths."""
    _, _, dp = layout(env, p)
    real = env.prompt + env.extra["fill"] * env.completion
    tokens = env.global_batch / dp * real
    return max(1, math.ceil(tokens / (size * (env.prompt + env.completion) * 0.95)))


def training_peak(env: Env, p: dict[str, Any]) -> float:
    """Bytes of the heaviest stage in the update beyond its states: the first holds min(p, m)
    micro-batches in flight, the last one micro-batch and the vocab-parallel logits."""
    tp, pp, _ = layout(env, p)
    mb = int(p["train_micro_batch_size"])
    tokens = mb * (env.prompt + env.completion)
    body = env.layers / pp * layer_bytes(env, p, tokens)
    recomputing = layer_bytes(env, p, tokens, kept=False) if p["activation_checkpointing"] else 0.0
    logits = tokens * env.vocab / tp * 4.0 * env.extra["logit_copies"] * env.physics.mem_logits
    in_flight = min(pp, micro_batches(env, p, mb))
    last = body + logits + recomputing
    return last if pp == 1 else max(body * in_flight + recomputing, last)


def logprob_peak(env: Env, p: dict[str, Any]) -> float:
    """Bytes of a log-prob micro-batch beyond the bf16 weights: its logits and one layer's forward."""
    tp = int(p["tensor_model_parallel_size"])
    tokens = int(p["logprob_batch_size"]) * (env.prompt + env.completion)
    logits = tokens * env.vocab / tp * 4.0 * env.extra["logit_copies"] * env.physics.mem_logits
    return logits + tokens * env.hidden * 20.0 / tp * env.physics.mem_acts


def kv_per_token(env: Env) -> float:
    """Bytes of KV cache a token takes on one GPU of an engine."""
    return 2.0 * env.layers * env.hidden * 2.0 * env.extra["kv_ratio"] / env.extra["vllm_tp"]


def _step_s(env: Env, p: dict[str, Any], concurrency: int, refit_free: float) -> float:
    """Seconds of one step: rollout, refit, host trips, two log-prob passes, the update."""
    ph, g = env.physics, env.gpus
    tp, pp, dp = layout(env, p)
    P, ps = env.params_b * 1e9, stage_params(env, tp, pp)
    seq, real = env.prompt + env.completion, env.prompt + env.extra["fill"] * env.completion
    tokens = env.global_batch * real  # sequence packing: no padding is computed
    link, host = env.extra["link_gbs"] * 1e9 / ph.speed_comm, HOST_BW / ph.speed_offload
    hbm = env.extra["hbm_tbs"] * 1e12
    vtp = int(env.extra["vllm_tp"])
    # rollout: engines of vtp GPUs decode in waves; a step reads the weights and the live KV cache
    per_engine = math.ceil(env.global_batch / (g // vtp))
    live = min(concurrency, per_engine)
    waves = math.ceil(per_engine / max(concurrency, 1))
    token_s = 0.006 + (2.0 * P / vtp + live * real / 2 * kv_per_token(env)) / hbm
    token_s *= 1.0 + 0.1 * (vtp - 1) * ph.speed_comm
    rollout = waves * env.completion * (0.5 + 0.5 * env.extra["fill"]) * token_s * ph.speed_gen
    # refit: TP shards gathered, PP stages broadcast, streamed in chunks of 30% of what is free
    chunks = math.ceil(2.0 * P / max(0.3 * refit_free, 0.25 * GIB))
    gather = 2.0 * P * ((tp - 1) / tp + (pp - 1) / pp) / link + 2.0 * P / vtp / hbm
    refit = (gather + chunks * REFIT_CHUNK_S) * ph.speed_sync
    # the host: the weights out and back, the reference's swapped in and the policy's restored, the
    # engine's weights put to sleep and woken, the optimizer out and back unless it lives there
    trips = 2 * 2.0 * ps + 3 * 2.0 * ps + 2 * 2.0 * P / vtp
    if not p["optimizer_cpu_offload"]:
        trips += 2 * 12.0 * ps / dp
    swaps = trips / host
    # compute: the GEMMs' efficiency grows with a micro-batch's tokens and shrinks with TP's narrower
    # matrices; 1F1B idles (p-1)/(m+p-1) of each pass; TP all-reduces each layer's activations
    width = 1.0 + 0.07 * math.log2(tp)
    if p["sequence_parallel"] and tp > 1:
        width *= 1.0 - 0.02 * (tp - 1) / tp  # layer norms and dropouts no longer done TP times over

    def one_pass(flops: float, size: int, reduces: int) -> float:
        mbt = size * seq
        eff = 0.5 * mbt / (mbt + env.extra["micro_half"]) / width
        m = micro_batches(env, p, size)
        compute = flops / (g * env.tflops * 1e12 * eff) * ph.speed_compute
        # each all-reduce: its bytes over the link, and a latency far longer over PCIe than NVLink
        reduce_s = 2.0 * mbt * env.hidden * 2.0 * (tp - 1) / tp / link
        reduce_s += 0.003 / env.extra["link_gbs"] if tp > 1 else 0.0
        comm = m * env.layers / pp * reduces * reduce_s
        return (compute + comm) * (m + pp - 1) / m

    lp = int(p["logprob_batch_size"])
    logprob = 2 * one_pass(2.0 * P * tokens, lp, 2)  # the old policy's and the reference's
    recompute = 1.0
    if p["activation_checkpointing"]:
        recompute = 4.0 / 3.0 if p["recompute_granularity"] == "full" else 1.0 + env.extra["selective_cost"]
    full = p["activation_checkpointing"] and p["recompute_granularity"] == "full"
    update = one_pass(6.0 * P * tokens * recompute, int(p["train_micro_batch_size"]), 6 if full else 4)
    update += 0.3 * 6.0 * ps * (dp - 1) / dp / link  # the gradients' reduce-scatter left unhidden
    if p["optimizer_cpu_offload"]:  # Adam on the host's cores, fp32 gradients down and weights up
        rate = env.extra["cpu_adam"] / ph.speed_offload
        update += ps / dp / rate + 8.0 * ps / dp / host
    return rollout + refit + swaps + logprob + update


def truth(params: dict[str, Any], env: Env, seed: int, max_steps: int) -> TrialTruth:
    """What one trial of the NeMo-RL-style trainer shows (see the module docstring)."""
    rng = trial_rng(params, seed, "nemo")
    crash_rng = random.Random(f"crash:{seed}:{rng.random()}")
    p, ph, cap = params, env.physics, env.gpu_gib * GIB
    P, vtp = env.params_b * 1e9, int(env.extra["vllm_tp"])
    util = float(p["gpu_memory_utilization"])
    info: dict[str, Any] = {"util": util}
    vllm_s = 40.0 + env.params_b * 3.0 * rng.uniform(0.9, 1.2)
    # vLLM starts first, alone on the card, and checks its share against what is free
    free = cap - (0.5 + 0.2 * (vtp > 1)) * GIB * ph.mem_ctx
    if util * cap > free * ph.free_margin:
        info["free_gib"] = free / GIB
        return dies_at_start(env, "vllm_startup", "vllm_free_memory", vllm_s * 0.6, info)
    weights = 2.0 * P / vtp
    kv = util * cap - weights - 1.0 * GIB * ph.mem_engine
    seq = env.prompt + env.completion
    if kv < seq * kv_per_token(env) * ph.kv_need:
        return dies_at_start(env, "vllm_kv", "vllm_no_cache_blocks", vllm_s * 0.9, info)
    concurrency = int(kv // (seq * kv_per_token(env)))
    # then the policy: NeMo-RL's and Megatron's checks, then its states onto the card beside the
    # sleeping engine
    refused = refusal(env, p)
    policy_s = vllm_s + 30.0 + env.params_b * 5.0 * rng.uniform(0.9, 1.2)
    if refused:
        info["invalid"] = refused
        return dies_at_start(env, "invalid", "megatron_config", vllm_s + 15.0, info)
    tp, pp, dp = layout(env, p)
    groups = (tp > 1) + (pp > 1) + (dp > 1)  # NCCL communicators the policy holds
    ctx = (0.6 + 0.15 * groups) * GIB * ph.mem_ctx
    asleep = 0.4 * GIB * ph.mem_engine  # what the sleeping engine keeps (CUDA graphs, its pool)
    loaded = ctx + asleep + states(env, p)
    if loaded > cap:
        info["oom"] = oom_numbers(rng, env.gpu_gib, loaded, 2.0 * stage_params(env, tp, pp), ctx, 0.05 * GIB)
        return dies_at_start(env, "cuda", "cuda_oom", policy_s * 0.8, info)
    bf16 = 2.0 * stage_params(env, tp, pp) * ph.mem_states
    refit_free = max(cap - ctx - bf16 - weights, 0.0)
    peaks = (
        ctx + util * cap,  # rollout: the policy is on the host
        cap - 0.7 * refit_free,  # refit: the policy's weights, the engine's, a buffer of 30% of the rest
        ctx + asleep + bf16 + logprob_peak(env, p),
        loaded + training_peak(env, p),
    )
    plan = Plan(
        startup_s=policy_s,
        step_s=_step_s(env, p, concurrency, refit_free),
        samples=env.global_batch,
        peak=max(peaks),
        creep=rng.uniform(0.01, 0.04) * ph.mem_creep,
        logged=env.logs_memory,
    )
    return play(plan, env, rng, crash_rng, max_steps)
