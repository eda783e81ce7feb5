"""A verl-style GRPO trainer, held out: an FSDP actor with a colocated vLLM rollout, in verl's names.

Written after the search had been shaped on the other families (docs/benchmarks-notes.md,
thirty-eighth pass), with functional forms none of them has, so that the benchmark can say how the
search does on a trainer it was never tuned on:

- FSDP gathers every parameter for each micro-batch, so a small ``ppo_micro_batch_size_per_gpu``
  pays the all-gathers many times over (more on PCIe cards than on NVLink), and the per-token
  log-probabilities of the old and reference policies run in micro-batches of their own
  (``log_prob_micro_batch_size_per_gpu``), whose fp32 logits are what runs out of memory first.
- The rollout's engine frees its KV cache while the actor trains; at start-up it asks for
  ``gpu_memory_utilization`` of the card beside whatever the actor keeps resident (``param_offload``
  and ``optimizer_offload`` park it on the host between phases, at the price of moving it each
  phase, and load it back for the phase that needs it: they make room for the engine, not for the
  update).
- ``tensor_model_parallel_size`` splits each engine's weights and cache over that many GPUs: fewer,
  faster engines with more cache each, paying an all-reduce per token.
"""

from __future__ import annotations

import math
import random
from typing import Any

from autotune.sim.family_base import Env, Plan, dies_at_start, play, trial_rng
from autotune.sim.truth import TrialTruth, oom_numbers
from autotune.units import GIB

SPACE = "verl.yaml"
PROGRAM = "/workspace/verl/verl/trainer/main_ppo.py"
TEMPLATE = (
    "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_batch_size={global_batch} "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={ppo_micro_batch_size_per_gpu} "
    "actor_rollout_ref.model.enable_gradient_checkpointing={enable_gradient_checkpointing} "
    "actor_rollout_ref.actor.fsdp_config.param_offload={param_offload} "
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload={optimizer_offload} "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={log_prob_micro_batch_size_per_gpu} "
    "actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization} "
    "actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_model_parallel_size} "
    "trainer.total_training_steps={max_steps} trainer.default_local_dir={trial_dir}"
)
# data.train_batch_size is verl's prompts per step; the trainer here takes autotune's completions per
# step in its place (no verl runs: the text is what a trial's log and the export show)
HOST_BW = 12e9  # bytes/s host <-> GPU as a pinned copy reaches it (before the landscape's factor)


def _resident(env: Env, p: dict[str, Any]) -> tuple[float, float, float]:
    """Bytes per GPU of the actor and reference: (kept on the card beside the rollout's engine, the
    weights and gradients while the actor trains, Adam's moments). FSDP shards fp32 weights,
    gradients and Adam's two moments over every GPU; ``param_offload`` and ``optimizer_offload`` park
    them on the host between phases and load them back for each (the weights for the log-probs and
    the update, the moments for the optimizer's step), so they lower the rollout's residency, not the
    update's peak. The reference's bf16 weights go with the parameters."""
    P = env.params_b * 1e9 * env.physics.mem_states
    g = env.gpus
    weights, grads, adam, reference = 4.0 * P / g, 4.0 * P / g, 8.0 * P / g, 2.0 * P / g
    gathered = 2.0 * P / env.layers * 2  # one layer unsharded in bf16, and the next one prefetched
    beside = (0.0 if p["param_offload"] else weights + reference) + (0.0 if p["optimizer_offload"] else adam)
    training = weights + grads + gathered + (0.0 if p["param_offload"] else reference)
    return beside, training, adam


def _activations(env: Env, p: dict[str, Any]) -> tuple[float, float]:
    """Bytes per GPU of (a training micro-batch, a log-prob micro-batch)."""
    ph, seq = env.physics, env.prompt + env.completion
    mb, lp = p["ppo_micro_batch_size_per_gpu"], p["log_prob_micro_batch_size_per_gpu"]
    per_token = (2.5 if p["enable_gradient_checkpointing"] else 26.0) * env.hidden * env.layers * ph.mem_acts
    logits = env.completion * env.vocab * 4.0 * env.extra["logit_copies"] * ph.mem_logits
    return mb * (seq * per_token + logits), lp * (seq * 2.0 * env.hidden * 4 + logits)


def _step_s(env: Env, p: dict[str, Any], concurrency: int) -> float:
    """Seconds of one GRPO step: rollout, two log-prob passes (old policy and reference), update."""
    ph, g = env.physics, env.gpus
    P = env.params_b * 1e9
    tp = p["tensor_model_parallel_size"]
    mb, lp = p["ppo_micro_batch_size_per_gpu"], p["log_prob_micro_batch_size_per_gpu"]
    per_gpu = env.global_batch / g
    tokens = env.global_batch * (env.prompt + env.completion)
    bw = env.extra["link_gbs"] * 1e9 / ph.speed_comm
    gather = 2.0 * P * (g - 1) / g / bw  # one all-gather of the bf16 weights
    # rollout: engines of tp GPUs, each decoding its share in waves of its cache's concurrency
    engines = g // tp
    waves = math.ceil(env.global_batch / engines / max(concurrency, 1))
    token_s = (0.008 + 2.0 * P / tp / (env.extra["hbm_tbs"] * 1e12)) * (1.0 + 0.12 * (tp - 1) * ph.speed_comm)
    rollout = env.completion * token_s * waves * ph.speed_gen + 2.0 * P / bw * ph.speed_sync
    # log-probs: forward only, per micro-batch one gather per model
    lp_eff = 0.4 * lp / (lp + env.extra["micro_half"] / 2)
    logprob = 2 * (2.0 * P * tokens / (g * env.tflops * 1e12 * lp_eff) * ph.speed_compute)
    logprob += 2 * math.ceil(per_gpu / lp) * gather
    # update: forward and backward per micro-batch, two gathers and a reduce-scatter each
    eff = 0.45 * mb / (mb + env.extra["micro_half"])
    flops = 6.0 * P * tokens * (1.33 if p["enable_gradient_checkpointing"] else 1.0)
    update = flops / (g * env.tflops * 1e12 * eff) * ph.speed_compute + math.ceil(per_gpu / mb) * 3 * gather
    host = HOST_BW / ph.speed_offload
    if p["param_offload"]:  # the shards go to the host after each phase and come back for the next
        phases = 2 * (4.0 * P / g) + 2 * (2.0 * P / g)  # actor for log-probs and update, reference
        update += 2 * phases / host
    if p["optimizer_offload"]:  # Adam's moments come to the card for the step and go back
        update += 2 * 8.0 * P / g / host
    return rollout + logprob + update


def truth(params: dict[str, Any], env: Env, seed: int, max_steps: int) -> TrialTruth:
    """What one trial of the verl-style trainer shows (see the module docstring)."""
    rng = trial_rng(params, seed, "verl")
    crash_rng = random.Random(f"crash:{seed}:{rng.random()}")
    p, ph, cap = params, env.physics, env.gpu_gib * GIB
    P = env.params_b * 1e9
    tp = int(p["tensor_model_parallel_size"])
    util = float(p["gpu_memory_utilization"])
    info: dict[str, Any] = {"util": util}
    ctx = (0.7 + 0.04 * env.gpus) * GIB * ph.mem_ctx
    startup_s = 50.0 + env.params_b * 8.0 * rng.uniform(0.9, 1.2) + (20.0 if p["param_offload"] else 0.0)
    at_start, in_training, adam = _resident(env, p)
    if ctx + at_start > cap:
        info["oom"] = oom_numbers(rng, env.gpu_gib, ctx + at_start, 4.0 * P / env.gpus, ctx, 0.05 * GIB)
        return dies_at_start(env, "cuda", "cuda_oom", startup_s * 0.4, info)
    free = cap - ctx - at_start
    if util * cap > free * ph.free_margin:  # the engine starts after the actor has loaded
        info["free_gib"] = free / GIB
        return dies_at_start(env, "vllm_startup", "vllm_free_memory", startup_s * 0.7, info)
    kv_per_token = 2.0 * env.layers * env.hidden * 2.0 * env.extra["kv_ratio"] / tp
    kv = util * cap - 2.0 * P / tp - 1.0 * GIB * ph.mem_engine
    seq = env.prompt + env.completion
    if kv < seq * kv_per_token * ph.kv_need:
        return dies_at_start(env, "vllm_kv", "vllm_no_cache_blocks", startup_s * 0.9, info)
    concurrency = int(kv // (seq * kv_per_token))
    train_acts, logprob_acts = _activations(env, p)
    engine_asleep = 0.4 * GIB * ph.mem_engine  # what the engine keeps while its cache is freed
    rollout_peak = ctx + at_start + util * cap
    # the moments stay beside the activations unless parked, then they come only for the step
    optimizer_step = adam if p["optimizer_offload"] else 0.0
    kept_adam = 0.0 if p["optimizer_offload"] else adam
    training_peak = (
        ctx + in_training + engine_asleep + kept_adam + max(train_acts, logprob_acts, optimizer_step)
    )
    plan = Plan(
        startup_s=startup_s,
        step_s=_step_s(env, p, concurrency),
        samples=env.global_batch,
        peak=max(rollout_peak, training_peak),
        creep=rng.uniform(0.01, 0.04) * ph.mem_creep,
        logged=env.logs_memory,
    )
    return play(plan, env, rng, crash_rng, max_steps)
