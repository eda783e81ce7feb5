"""Ground truth of the simulated GRPO trainer: what a trial *would* measure on real hardware.

``evaluate(spec)`` maps one trial spec (parameters, recipe, model config, GPU) to what the trial
would show: startup time, per-step time (generation + training), per-step peak GPU memory, and
whether, when and how it fails. It is a pure, deterministic function of the spec and its seed, and
cheap (well under a millisecond) so that a benchmark can score a search strategy over thousands of
configurations without launching processes.

Why the truth is self-contained: the planner/estimator in autotune is supposed to *learn* this
landscape from trials. If it imported these formulas or constants, a benchmark would measure
copying, not learning. So the truth lives in autotune/sim only (this module and what it draws on:
``scenario`` parses the spec, ``truth`` holds the result types and OOM-message numbers,
``generation`` times one engine's generation, ``footprint`` and ``timing`` hold the memory and time
terms, ``physics`` the landscape's random factors; only the unit ``autotune.units.GIB`` is shared), and
it deliberately contains things a textbook estimator does not know: CUDA context and NCCL buffers,
allocator fragmentation that grows with the micro-batch and creeps over the first steps, a rank-0
surplus, run-to-run noise, slow warm-up steps, vLLM's KV-cache arithmetic and start-up checks, host
RAM for offload, PCIe and CPU-Adam costs, ZeRO communication.

Modelling choices worth knowing (each mirrors a real behaviour or the brief):
- Launch order: model load -> DeepSpeed states on the GPU -> vLLM engine. vLLM's start-up check
  therefore sees the trainer's model states (fraction x total must fit in what is left).
- zero_stage 0 is DeepSpeed stage 0 (bf16 weights + grads, fp32 master and Adam: 16 bytes/param).
  Optimizer offload needs stage >= 1 and parameter offload stage 3; below that DeepSpeed ignores it.
- Sleep mode is TRL's level 2: while training, the engine keeps only its CUDA-graph pool; it wakes
  to the full fraction for generation, and the wake-up can fail (cumem OOM) when fragmentation crept.
- vllm_mode "server": vllm_tensor_parallel_size x vllm_data_parallel_size GPUs serve at
  `vllm_server_gpu_memory_utilization` (default 0.9, vllm-serve's default); the rest train.
- Completions always run to max_completion_length (a tuning trial's worst case).
- Every memory and speed term is multiplied by the spec's ``physics`` factors (neutral by default);
  a trial may die of a transient NCCL watchdog timeout at the physics' crash rate (a crash, not an
  OOM: the configuration is fine, the run was unlucky).
- Failure steps: 0 = start-up; CUDA OOM at step 1 for what never fits; fragmentation creep kills
  configs within a few percent of capacity from step 3 on; CPUAdam's lazily created moments make
  a host OOM at step 1 possible.

Units: bytes internally, GiB (2**30) at the interface, seconds of *simulated* time.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

from autotune.sim.footprint import Footprint, host_memory, micro_batch, model_states, vllm_engine
from autotune.sim.scenario import Scenario, SpecError, parse_spec, trl_config_error
from autotune.sim.timing import StepCost, describe, engine_sequences, startup_times, step_cost
from autotune.sim.truth import Failure, TrialTruth, oom_numbers
from autotune.units import GIB

# the names callers import from here (the trainer, the replay executor, the benchmark, tests)
__all__ = ["GIB", "Failure", "Scenario", "SpecError", "TrialTruth", "evaluate", "parse_spec"]

#: torch's default NCCL watchdog timeout: a transient hang costs this much before the process dies
WATCHDOG_S = 600.0


def _rng(spec: dict, seed: int) -> random.Random:
    """Noise is keyed by seed AND configuration: two configs with one seed still differ, like two
    real runs would, while the same spec+seed always gives the same trial."""
    key = json.dumps(
        [
            seed,
            spec.get("params"),
            spec.get("recipe"),
            spec.get("gpu"),
            sorted((spec.get("model_config") or {}).items(), key=lambda kv: kv[0])
            if isinstance(spec.get("model_config"), dict)
            else None,
        ],
        sort_keys=True,
        default=str,
    )
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))


def evaluate(spec: dict) -> TrialTruth:
    """The ground truth for one trial spec (see the module docstring). Raises SpecError."""
    sc = parse_spec(spec)
    # the crash draw has its own stream, so a crash rate changes nothing else about a trial
    return _evaluate(
        sc, _rng(spec, sc.seed), random.Random(f"crash:{sc.seed}:{_rng(spec, sc.seed).random()}")
    )


class _Result:
    """Builds the TrialTruth of one scenario (the fields every ending shares)."""

    def __init__(self, sc: Scenario, n: int, info: dict[str, Any]) -> None:
        self.sc, self.info = sc, info
        k = sc.k
        self.samples = k.pdbs * k.ga * max(n, 0)
        self.tokens = self.samples * (sc.prompt + sc.completion)

    def __call__(
        self,
        startup: float,
        failure: Failure | None,
        fail_after: float = 0.0,
        times: tuple[list, list, list, list] = ([], [], [], []),
        startup_peak: float = 0.0,
    ) -> TrialTruth:
        return TrialTruth(
            startup_s=startup,
            step_times=times[0],
            generation_times=times[1],
            training_times=times[2],
            peak_memory_gib=times[3],
            startup_peak_gib=startup_peak,
            failure=failure,
            samples_per_step=self.samples,
            tokens_per_step=self.tokens,
            capacity_gib=self.sc.gpu.mem,
            max_steps=self.sc.max_steps,
            fail_after_s=fail_after,
            info=self.info,
        )


def _evaluate(sc: Scenario, rng: random.Random, crash_rng: random.Random) -> TrialTruth:
    k, m = sc.k, sc.m
    n = sc.gpus - (k.tp * k.vllm_dp if k.server else 0)  # data-parallel training GPUs
    info: dict[str, Any] = {"params_b": m.params / 1e9, "n_train_gpus": n, "world_size": sc.gpus}
    result = _Result(sc, n, info)
    # -- start-up clock (hidden: imports, rendezvous, disk speed, CUDA graph capture) ----------
    t_import = 11.0 + rng.uniform(0.0, 5.0) + (2.5 if sc.gpus > 1 else 0.0)
    bad = trl_config_error(sc, n)
    if bad:
        info["invalid"] = bad
        info["gen_batch"] = k.pdbs * max(n, 0) * k.spg
        return result(t_import + 1.5, Failure("invalid", 0, bad), fail_after=0.0)
    lora = sc.lora_rank is not None
    A = (sc.lora_rank or 0) * m.lora_targets * m.layers if lora else m.params  # trainable params
    # with LoRA TRL uses the base model with adapters off as the reference
    fp = Footprint(n=n, P=m.params, A=A, lora=lora, ref=sc.beta != 0.0 and not lora)
    info["trainable_b"] = A / 1e9
    model_states(sc, fp, rng, info)
    micro_batch(sc, fp, rng, info)
    vllm_engine(sc, fp, rng, info)
    host_memory(sc, fp, info)
    phases = startup_times(sc, fp, rng, t_import)
    info["phases"] = {**phases, "load": phases["load"] - t_import}
    early = _startup_failure(sc, fp, rng, phases, info, result)
    if early is not None:
        return early
    startup_s = phases["load"] + phases["deepspeed"] + phases["vllm"] + 2.0
    startup_peak = (fp.ctx + fp.states + fp.rank0_extra + fp.vllm_gen) / GIB
    seqs_engine = engine_sequences(sc, n)
    cost = step_cost(sc, fp, seqs_engine)
    describe(cost, sc, info)
    times, failure, fail_after = _run_steps(sc, fp, cost, seqs_engine, rng, crash_rng, info)
    return result(startup_s, failure, fail_after, times, startup_peak)


def _startup_failure(
    sc: Scenario,
    fp: Footprint,
    rng: random.Random,
    phases: dict[str, float],
    info: dict[str, Any],
    result: _Result,
) -> TrialTruth | None:
    """DeepSpeed's states, host RAM and vLLM's start-up checks, in launch order; None if all pass."""
    k, cap = sc.k, sc.gpu.mem
    t_load, t_ds, t_vllm = phases["load"], phases["deepspeed"], phases["vllm"]
    startup_states = fp.ctx + fp.states + fp.rank0_extra
    if startup_states > cap * GIB:
        # DeepSpeed allocates its fp32 partitions in deepspeed.initialize: dies before training
        shard = fp.n if k.zero >= 1 else 1
        info["oom"] = oom_numbers(
            rng,
            cap,
            startup_states,
            alloc=min(4.0 * fp.A / shard, startup_states * 0.5),
            non_torch=fp.ctx,
            unalloc=0.05 * GIB,
        )
        info["oom_where"] = "deepspeed_init"
        return result(t_load + t_ds * 0.6, Failure("cuda", 0, "cuda_oom"), startup_peak=cap)
    if fp.host_init > fp.host_limit:
        return result(t_load + t_ds * 0.8, Failure("host", 0, "sigkill"), startup_peak=startup_states / GIB)
    if not k.use_vllm:
        return None
    free = cap * GIB - (0.0 if k.server else startup_states)
    if fp.budget > free * sc.physics.free_margin:
        info["free_gib"] = free / GIB
        return result(
            t_load + t_ds + 6.0,
            Failure("vllm_startup", 0, "vllm_free_memory"),
            startup_peak=startup_states / GIB,
        )
    kv_need = sc.max_model_len * fp.kvb_gpu * sc.physics.kv_need
    peak = (startup_states + fp.budget) / GIB
    if fp.kv_mem <= 0:
        return result(
            t_load + t_ds + t_vllm * 0.5, Failure("vllm_kv", 0, "vllm_no_cache_blocks"), startup_peak=peak
        )
    if fp.kv_mem < kv_need:
        info["kv_need_gib"] = kv_need / GIB
        info["est_max_len"] = int(fp.kv_mem // fp.kvb_gpu) // 16 * 16
        return result(
            t_load + t_ds + t_vllm * 0.5, Failure("vllm_kv", 0, "vllm_kv_max_seq"), startup_peak=peak
        )
    return None


def _phase_memory(sc: Scenario, fp: Footprint) -> tuple[float, float, float]:
    """Peak bytes of the training phase, the generation phase (0: none of its own) and a server GPU."""
    k, m = sc.k, sc.m
    base = fp.ctx + fp.rank0_extra + fp.states
    train_phase = base + fp.dyn + fp.vllm_train
    if not k.use_vllm:
        seqs_gen = k.pdbs * k.spg
        s_len = sc.prompt + sc.completion
        gathered = 2.0 * fp.P * (1 - 1 / fp.n) if k.zero == 3 else 0.0
        hf_kv = seqs_gen * s_len * m.kv_bytes_per_token + seqs_gen * m.vocab * 4.0 * 3
        gen_phase = base + gathered + hf_kv
    elif k.sleep:
        gen_phase = base + 0.4 * GIB + 0.06 * fp.dyn + fp.vllm_gen
    else:
        gen_phase = 0.0
    server_peak = (fp.ctx + k.util * sc.gpu.mem * GIB + fp.vllm_outside) if k.server else 0.0
    return train_phase, gen_phase, server_peak


def _oom(
    sc: Scenario, fp: Footprint, rng: random.Random, where: str, demand: float, creep: float, seqs: int
) -> dict:
    """PyTorch's OOM numbers for a failure in generation or training (``info['oom']``)."""
    k, m, cap = sc.k, sc.m, sc.gpu.mem
    s_len = sc.prompt + sc.completion
    if where == "generation":
        alloc = (k.util * cap * GIB - fp.w_vllm) * 0.5 if k.sleep else seqs * s_len * m.kv_bytes_per_token
        non_torch = fp.ctx + (fp.vllm_gen if k.sleep else 0.0)
        unalloc = 0.06 * fp.dyn + creep
    else:
        big_logits = fp.logits >= fp.acts and not k.liger
        alloc = (k.pdbs * sc.completion * m.vocab * 4.0) if big_logits else s_len * k.pdbs * m.inter * 4.0
        non_torch = fp.ctx + (fp.vllm_train if k.sleep else fp.vllm_outside)
        unalloc = (fp.frag - 1.0) * (fp.acts + fp.logits) + creep
    return oom_numbers(rng, cap, demand, alloc=alloc, non_torch=non_torch, unalloc=unalloc)


def _run_steps(
    sc: Scenario,
    fp: Footprint,
    cost: StepCost,
    seqs_engine: int,
    rng: random.Random,
    crash_rng: random.Random,
    info: dict[str, Any],
) -> tuple[tuple[list, list, list, list], Failure | None, float]:
    """Play the optimizer steps: warm-up, noise, fragmentation creep, OOMs and transient crashes."""
    k, ph, cap = sc.k, sc.physics, sc.gpu.mem * GIB
    train_phase, gen_phase, server_peak = _phase_memory(sc, fp)
    creep_max = (
        rng.uniform(0.025, 0.045) * (fp.states + fp.dyn) * (0.35 if k.empty_cache else 1.0) * ph.mem_creep
    )
    tau = rng.uniform(1.6, 2.6)
    mem_offset = rng.gauss(0.0, 0.0025 * sc.gpu.mem) * GIB
    run_factor = math.exp(rng.gauss(0.0, ph.noise))
    crash_at = crash_rng.randint(1, min(sc.max_steps, 8)) if crash_rng.random() < ph.crash_rate else 0
    times: tuple[list, list, list, list] = ([], [], [], [])
    for step in range(1, sc.max_steps + 1):
        n_gens = sum(1 for i in range((step - 1) * k.ga, step * k.ga) if i % k.spg == 0)
        g_t = n_gens * (cost.gen_s + cost.sync_s)
        t_t = cost.train_s + cost.misc_s
        noise = run_factor * math.exp(rng.gauss(0.0, ph.step_sigma))
        if step == 1:
            warm = rng.uniform(1.3, 1.55)
            g_t, t_t = g_t * warm + rng.uniform(2.0, 5.0), t_t * warm + rng.uniform(2.0, 4.0)
        elif step == 2:
            warm = rng.uniform(1.06, 1.14)
            g_t, t_t = g_t * warm, t_t * warm
        g_t, t_t = g_t * noise, t_t * noise
        creep = creep_max * (1.0 - math.exp(-(step - 2) / tau)) if step >= 3 else 0.0
        jitter = abs(rng.gauss(0.0, 0.05)) * GIB
        tp_peak = train_phase + creep + mem_offset + jitter
        gp_peak = (gen_phase + creep + mem_offset + jitter) if gen_phase else 0.0
        if step == 1 and fp.host_step1 > fp.host_limit:  # CPUAdam allocates its moments in step 1
            return times, Failure("host", 1, "sigkill"), g_t + t_t * 0.97
        if gp_peak > cap and n_gens:
            info["oom"] = _oom(sc, fp, rng, "generation", gp_peak, creep, seqs_engine)
            info["oom_where"] = "generation"
            return times, Failure("cuda", step, "cumem_oom" if k.sleep else "cuda_oom"), g_t * 0.1
        if tp_peak > cap:
            info["oom"] = _oom(sc, fp, rng, "training", tp_peak, creep, seqs_engine)
            info["oom_where"] = "logits" if (fp.logits >= fp.acts and not k.liger) else "layer"
            return times, Failure("cuda", step, "cuda_oom"), g_t + min(t_t, cost.micro_batch_s * 1.2)
        if step == crash_at:
            info["nccl_seq"] = 40 * step + crash_rng.randint(0, 39)
            return times, Failure("transient", step, "nccl_timeout"), g_t + WATCHDOG_S
        for series, value in zip(times, (g_t + t_t, g_t, t_t, max(tp_peak, gp_peak, server_peak) / GIB)):
            series.append(value)
    return times, None, 0.0
