"""A plain trainer whose speed grows with its micro-batch up to an out-of-memory edge.

Other functional forms than the GRPO simulator: throughput rises as ``micro / (micro + k)`` with a
landscape's own ``k``, memory is a base plus a per-sample slope, ``activation_offload`` halves the
slope at a price in speed, and two knobs (``dataloader_workers``, ``log_interval``) change nothing
at all. Some landscapes' trainer logs no memory: then a trial reports no peak, and a configuration
a few percent under capacity dies later in a long run, when the allocator's creep reaches it.
"""

from __future__ import annotations

import random
from typing import Any

from autotune.sim.family_base import Env, Plan, play, trial_rng
from autotune.sim.truth import TrialTruth
from autotune.units import GIB

SPACE = "plain.yaml"
PROGRAM = "/workspace/plain_trainer/train.py"
TEMPLATE = (
    "python /workspace/plain_trainer/train.py --micro_batch_size {micro_batch_size} "
    "--global_batch_size {global_batch} --activation_offload {activation_offload} "
    "--dataloader_workers {dataloader_workers} --log_interval {log_interval} "
    "--fused_adam {fused_adam} --max_steps {max_steps} --output {trial_dir}"
)


def truth(params: dict[str, Any], env: Env, seed: int, max_steps: int) -> TrialTruth:
    """What one trial of the plain trainer shows (see the module docstring)."""
    rng = trial_rng(params, seed, "plain")
    crash_rng = random.Random(f"crash:{seed}:{rng.random()}")
    ph, mb = env.physics, int(params["micro_batch_size"])
    offload = bool(params["activation_offload"])
    P = env.params_b * 1e9
    base = (16.0 * P / env.gpus + 2.0 * P) * ph.mem_states + 0.8 * GIB * ph.mem_ctx
    per_sample = env.extra["sample_gib"] * GIB * ph.mem_acts * (0.5 if offload else 1.0)
    k = env.extra["micro_half"]
    samples = env.global_batch
    tokens = samples * (env.prompt + env.completion)
    eff = 0.5 * mb / (mb + k)
    step = 6.0 * P * tokens / (env.gpus * env.tflops * 1e12 * eff) * ph.speed_compute
    step *= 1.0 + (0.25 * ph.speed_offload if offload else 0.0)
    step *= 0.97 if params["fused_adam"] else 1.0
    step += 0.3 + 0.02 * samples / env.gpus / mb  # per micro-step overhead
    plan = Plan(
        startup_s=30.0 + env.params_b * 6.0 * rng.uniform(0.9, 1.2),
        step_s=step,
        samples=samples,
        peak=base + mb * per_sample,
        creep=rng.uniform(0.02, 0.05) * ph.mem_creep,
        logged=env.logs_memory,
    )
    return play(plan, env, rng, crash_rng, max_steps)
