"""A PPO-style trainer with four models (actor, critic, reference, reward), in its own knob names.

Written apart from the GRPO simulator, with other functional forms: the models either share every
GPU (``colocate_all_models``, the engine sleeping while they train, the phases running one after
the other) or split the GPUs in two halves that overlap (actor + engine on one half, critic,
reference and reward on the other). ``adam_offload`` moves Adam's states to the host (less memory,
slower steps); ``n_samples_per_prompt`` shares each prompt's prefix in generation (whether that
pays is the landscape's own); ``vllm_gpu_memory_utilization`` sizes the engine's KV cache.
"""

from __future__ import annotations

import math
import random
from typing import Any

from autotune.sim.family_base import Env, Plan, dies_at_start, play, trial_rng
from autotune.sim.truth import TrialTruth, oom_numbers
from autotune.units import GIB

SPACE = "ppo.yaml"
PROGRAM = "/workspace/ppo_trainer/train_ppo.py"
TEMPLATE = (
    "python /workspace/ppo_trainer/train_ppo.py --micro_train_batch_size {micro_train_batch_size} "
    "--train_batch_size {global_batch} --n_samples_per_prompt {n_samples_per_prompt} "
    "--zero_stage {zero_stage} --adam_offload {adam_offload} --colocate_all_models {colocate_all_models} "
    "--gradient_checkpointing {gradient_checkpointing} --vllm_gpu_memory_utilization "
    "{vllm_gpu_memory_utilization} --max_steps {max_steps} --save_path {trial_dir}"
)


def _states(env: Env, p: dict[str, Any], shard: int) -> tuple[float, float]:
    """Bytes per GPU of (actor with its optimizer, critic + reference + reward)."""
    P = env.params_b * 1e9 * env.physics.mem_states
    z3, off = p["zero_stage"] == 3, p["adam_offload"]
    weights = 2.0 * P / (shard if z3 else 1)
    grads = 2.0 * P / (shard if p["zero_stage"] >= 2 else 1)
    adam = 0.0 if off else 12.0 * P / shard
    trained = weights + grads + adam + (0.8 * GIB if off else 0.0)  # pinned staging buffers
    critic = trained * env.extra.get("critic_size", 1.0)
    frozen = 2.0 * 2.0 * P / (shard if z3 else 1)  # reference and reward, bf16
    return trained, critic + frozen


def _activations(env: Env, p: dict[str, Any]) -> float:
    ph, mb = env.physics, p["micro_train_batch_size"]
    seq = env.prompt + env.completion
    per_layer = (2.0 if p["gradient_checkpointing"] else 30.0) * env.hidden
    acts = mb * seq * env.layers * per_layer * ph.mem_acts
    logits = mb * env.completion * env.vocab * 8.0 * ph.mem_logits
    return acts + logits


def _timing(env: Env, p: dict[str, Any], train_gpus: int, engine_gpus: int, conc: int) -> float:
    """Seconds of one PPO step (rollout, then actor and critic updates, with or without overlap)."""
    ph, mb = env.physics, p["micro_train_batch_size"]
    P = env.params_b * 1e9
    samples = env.global_batch
    tokens = samples * (env.prompt + env.completion)
    eff = 0.45 * mb / (mb + env.extra.get("micro_half", 3.0))
    flops = 6.0 * P * tokens * (1.33 if p["gradient_checkpointing"] else 1.0)
    train = flops / (train_gpus * env.tflops * 1e12 * eff) * ph.speed_compute
    fwd_frozen = 2 * 2.0 * P * tokens / (train_gpus * env.tflops * 1e12 * 0.4) * ph.speed_compute
    if p["adam_offload"]:
        train += 12.0 * P / max(train_gpus, 1) / 20e9 * ph.speed_offload + P / 2.5e9 * ph.speed_offload
    if p["zero_stage"] == 3:
        train *= 1.0 + 0.15 * ph.speed_comm
    share = env.extra.get("prefix_share", 0.1) * (1.0 - 1.0 / p["n_samples_per_prompt"])
    per_engine = math.ceil(samples / max(engine_gpus, 1))
    waves = math.ceil(per_engine / max(conc, 1))
    decode = env.completion * (0.012 + 2.0 * P / 2.4e12) * waves * (1.0 - share)
    gen = decode * ph.speed_gen + 2.0 * P / 40e9 * ph.speed_sync
    if p["colocate_all_models"]:
        return gen + 2.0 * train + fwd_frozen + 1.5  # wake-up and sleep of the engine
    return gen + max(train, train * env.extra.get("critic_size", 1.0) + fwd_frozen) * 1.05


def truth(params: dict[str, Any], env: Env, seed: int, max_steps: int) -> TrialTruth:
    """What one trial of the PPO trainer shows (see the module docstring)."""
    rng = trial_rng(params, seed, "ppo")
    crash_rng = random.Random(f"crash:{seed}:{rng.random()}")
    p, ph, cap = params, env.physics, env.gpu_gib * GIB
    colocate = bool(p["colocate_all_models"])
    half = max(env.gpus // 2, 1)
    train_gpus = env.gpus if colocate else half
    trained, others = _states(env, p, train_gpus)
    ctx = (0.9 + 0.05 * env.gpus) * GIB * ph.mem_ctx
    startup_s = 40.0 + env.params_b * 9.0 * rng.uniform(0.9, 1.2)
    on_actor = trained + (others if colocate else 0.0)
    util = float(p["vllm_gpu_memory_utilization"])
    info: dict[str, Any] = {"util": util}
    free = cap - ctx - (0.0 if colocate else on_actor)  # colocated: the engine starts first
    if util * cap > free * ph.free_margin:
        info["free_gib"] = free / GIB
        return dies_at_start(env, "vllm_startup", "vllm_free_memory", startup_s * 0.6, info)
    P = env.params_b * 1e9
    kv_per_token = 2.0 * env.layers * env.hidden * 2.0 * env.extra.get("kv_ratio", 0.25)
    kv = util * cap - 2.0 * P - 1.2 * GIB * ph.mem_engine
    seq = env.prompt + env.completion
    if kv < seq * kv_per_token * ph.kv_need:
        return dies_at_start(env, "vllm_kv", "vllm_no_cache_blocks", startup_s * 0.8, info)
    conc = int(kv // (seq * kv_per_token))
    acts = _activations(env, p)
    engine_train = 0.25 * GIB if colocate else util * cap  # the engine sleeps while colocated models train
    actor_gpu = ctx + on_actor + acts + engine_train
    critic_gpu = ctx + others + acts if not colocate else 0.0
    peak = max(actor_gpu, critic_gpu)
    if ctx + on_actor > cap:
        info["oom"] = oom_numbers(rng, env.gpu_gib, ctx + on_actor, 2.0 * P / train_gpus, ctx, 0.05 * GIB)
        return dies_at_start(env, "cuda", "cuda_oom", startup_s * 0.5, info)
    engines = env.gpus if colocate else half
    plan = Plan(
        startup_s=startup_s,
        step_s=_timing(env, p, train_gpus, engines, conc),
        samples=env.global_batch,
        peak=peak,
        creep=rng.uniform(0.01, 0.035) * ph.mem_creep,
        logged=env.logs_memory,
    )
    return play(plan, env, rng, crash_rng, max_steps)
