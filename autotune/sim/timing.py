"""How long the simulated GRPO trainer takes: start-up phases and the cost of one optimizer step.

Each term is scaled by the landscape's physics (compute, generation, collectives, offload, weight
sync), so benchmark landscapes differ in where the time goes, not only in how much of it there is.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from autotune.sim.footprint import Footprint
from autotune.sim.generation import generation_time
from autotune.sim.scenario import Scenario


@dataclass
class StepCost:
    """Seconds of one optimizer step's parts (before warm-up and noise)."""

    gen_s: float
    sync_s: float
    micro_batch_s: float
    optimizer_s: float
    misc_s: float
    ga: int  # micro-batches per optimizer step
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def train_s(self) -> float:
        return self.micro_batch_s * self.ga + self.optimizer_s


def startup_times(sc: Scenario, fp: Footprint, rng: random.Random, t_import: float) -> dict[str, float]:
    """Import, model load, DeepSpeed initialisation and vLLM start-up (simulated seconds)."""
    k, P, A = sc.k, fp.P, fp.A
    z3 = k.zero == 3
    t_load = t_import + 2.0 + 2.0 * P / (1.8e9) * (2.0 if fp.ref else 1.0) * rng.uniform(0.85, 1.2)
    t_ds = (
        2.0
        + (4.0 + 0.6 * P / 1e9 if z3 else 1.0)
        + (16.0 * A / 5e9 if k.offload_opt else 0.0)
        + (2.0 * P / 5e9 if k.offload_params else 0.0)
    )
    t_vllm = 0.0
    if k.use_vllm:
        t_vllm = 6.0 + 2.0 * P / k.tp / 2.5e9 + 4.0 + rng.uniform(10.0, 28.0) + (2.0 if k.sleep else 0.0)
    return {"import": t_import, "load": t_load, "deepspeed": t_ds, "vllm": t_vllm}


def _sync_seconds(sc: Scenario, fp: Footprint, link: float, bw: float, pcie: float) -> float:
    """Weight sync trainer -> engine, once per generation (wake-up and HTTP included)."""
    k, m, P, n = sc.k, sc.m, fp.P, fp.n
    z3 = k.zero == 3
    if not k.use_vllm:
        sync = (2.0 * P * (1 - 1 / n) / link + 0.3) if z3 else 0.0
    elif k.server:
        sync = 2.0 * P / (link * 0.6) + m.n_tensors * 0.0022 + 0.5 + 0.35  # + HTTP round trips
    else:
        sync = (
            m.n_tensors * (0.008 if z3 else 0.0012)
            + 2.0 * P / (bw * 0.5)
            + (2.0 * P * (1 - 1 / n) / link if z3 and n > 1 else 0.0)
            + (2.0 * P / n / pcie if k.offload_params else 0.0)
            + (0.6 if fp.lora else 0.0)
        )
    if k.sleep:
        sync += 1.6 + 0.02 * k.util * sc.gpu.mem  # wake_up (re-allocate KV, reset caches) + sleep
    return sync * sc.physics.speed_sync


def _micro_batch_seconds(sc: Scenario, fp: Footprint, link: float, pcie: float) -> dict[str, float]:
    """Where one micro-batch's time goes: kernels, per-module hooks, exposed comm, PCIe."""
    k, m, ph = sc.k, sc.m, sc.physics
    P, A, n = fp.P, fp.A, fp.n
    b, C, h = k.pdbs, sc.completion, m.hidden
    s_len = sc.prompt + sc.completion
    T = b * s_len
    qd = m.heads * m.head_dim
    fwd = 2.0 * m.layers * m.layer_linear * T + 2.0 * h * m.vocab * b * C + 2.0 * b * s_len**2 * qd * m.layers
    passes = (
        1.0
        + (2.0 if not fp.lora else 1.1)
        + (1.0 if k.gc else 0.0)
        + (1.0 if fp.ref else 0.0)
        + (1.0 if k.spg > k.ga else 0.0)
    )
    if sc.quant_bits < 16:
        passes *= 1.25  # dequantising the base in every matmul
    mfu = (0.50 if sc.gpu.tflops < 700 else 0.42) * (T / (T + 1100.0)) * (h / (h + 500.0))
    compute = fwd * passes / (sc.gpu.tflops * 1e12 * mfu) * (1.04 if k.liger else 1.0) * ph.speed_compute
    parts = {"compute": compute, "hooks": 0.02, "comm": 0.0, "pcie": 0.0}
    hook_passes = 2 + (1 if k.gc else 0) + (1 if fp.ref else 0)
    if k.zero == 3:
        parts["hooks"] += hook_passes * m.n_modules * 0.00022 * (1.3 if k.offload_params else 1.0)
        if n > 1:
            comm = (hook_passes * 2.0 * P + 2.0 * A) * (1 - 1 / n) / link * ph.speed_comm
            parts["comm"] += max(comm - 0.7 * compute, 0.12 * comm)
    elif k.zero == 2 and n > 1:
        comm = 2.0 * A * (1 - 1 / n) / link * ph.speed_comm
        parts["comm"] += max(comm - 0.6 * compute, 0.1 * comm)
    if k.offload_opt:
        parts["pcie"] += (4.0 * A / n / pcie + 0.04) * ph.speed_offload  # fp32 grads to pinned host
    if k.offload_params:
        parts["pcie"] += hook_passes * (2.0 * P / n / pcie + m.n_modules * 0.0004) * ph.speed_offload
    return parts


def step_cost(sc: Scenario, fp: Footprint, seqs_engine: int) -> StepCost:
    """Generation, weight sync, one micro-batch, the optimizer step and the rest, in seconds."""
    k, ph, g = sc.k, sc.physics, sc.gpu
    A, n = fp.A, fp.n
    bw = g.bw * 1e12
    link = g.link * 1e9 * 0.72
    pcie = (45e9 if g.tflops >= 700 else 22e9) * (0.85 if n > 4 else 1.0)
    gen_s = generation_time(sc, sc.m, k, g, seqs_engine, fp.conc, fp.P) * ph.speed_gen
    parts = _micro_batch_seconds(sc, fp, link, pcie)
    if k.offload_opt:  # DeepSpeedCPUAdam shares the host's cores
        opt = (A / 1.1e9 + 2.0 * A / n / pcie + 0.4) * ph.speed_offload
    else:
        opt = 16.0 * A / (n if k.zero >= 1 else 1) * 2.0 / (bw * 0.6) + 0.08
    if n > 1 and k.zero <= 1:
        opt += 2.0 * 2.0 * A * (1 - 1 / n) / link * ph.speed_comm
    if n > 1 and k.zero in (1, 2):
        opt += 2.0 * A * (1 - 1 / n) / link * 0.8 * ph.speed_comm
    cost = StepCost(
        gen_s=gen_s,
        sync_s=_sync_seconds(sc, fp, link, bw, pcie),
        micro_batch_s=sum(parts.values()),
        optimizer_s=opt,
        misc_s=0.12 + 0.0015 * k.pdbs * k.ga + (0.05 if k.empty_cache else 0.0),
        ga=k.ga,
        parts=parts,
    )
    return cost


def engine_sequences(sc: Scenario, n: int) -> int:
    """Sequences one generation engine produces per generation round."""
    k = sc.k
    if k.server:
        return math.ceil(n * k.pdbs * k.spg / k.vllm_dp)
    return k.pdbs * k.spg * (k.tp if k.use_vllm else 1)


def describe(cost: StepCost, sc: Scenario, info: dict[str, Any]) -> None:
    """The step's parts into ``info`` (log lines and the gpu.csv timeline read them)."""
    k = sc.k
    info.update(
        gen_s=cost.gen_s,
        sync_s=cost.sync_s,
        micro_batch_s=cost.micro_batch_s,
        optimizer_s=cost.optimizer_s,
        misc_s=cost.misc_s,
        micro_batch_parts=cost.parts,
        wake_s=(1.6 + 0.02 * k.util * sc.gpu.mem) if k.sleep else 0.0,
    )
