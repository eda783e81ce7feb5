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
``generation`` times one engine's generation; only the unit ``autotune.units.GIB`` is shared), and
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

from autotune.sim.generation import generation_time
from autotune.sim.scenario import Scenario, SpecError, parse_spec, trl_config_error
from autotune.sim.truth import Failure, TrialTruth, oom_numbers
from autotune.units import GIB

# the names callers import from here (the trainer, the replay executor, the benchmark, tests)
__all__ = ["GIB", "Failure", "Scenario", "SpecError", "TrialTruth", "evaluate", "parse_spec"]


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
    return _evaluate(sc, _rng(spec, sc.seed))


def _evaluate(sc: Scenario, rng: random.Random) -> TrialTruth:  # noqa: C901 - one physical story
    m, k, g = sc.m, sc.k, sc.gpu
    cap = g.mem
    server_gpus = k.tp * k.vllm_dp if k.server else 0
    n = sc.gpus - server_gpus  # data-parallel training GPUs
    s_len = sc.prompt + sc.completion
    samples = k.pdbs * k.ga * max(n, 0)
    tokens = samples * s_len
    info: dict[str, Any] = {"params_b": m.params / 1e9, "n_train_gpus": n, "world_size": sc.gpus}

    def result(
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
            samples_per_step=samples,
            tokens_per_step=tokens,
            capacity_gib=cap,
            max_steps=sc.max_steps,
            fail_after_s=fail_after,
            info=info,
        )

    # -- start-up clock (hidden: imports, rendezvous, disk speed, CUDA graph capture) ----------
    t_import = 11.0 + rng.uniform(0.0, 5.0) + (2.5 if sc.gpus > 1 else 0.0)
    bad = trl_config_error(sc, n)
    if bad:
        info["invalid"] = bad
        info["gen_batch"] = k.pdbs * max(n, 0) * k.spg
        return result(t_import + 1.5, Failure("invalid", 0, bad), fail_after=0.0)

    P = m.params
    lora = sc.lora_rank is not None
    A = (sc.lora_rank or 0) * m.lora_targets * m.layers if lora else P  # trainable params
    ref = sc.beta != 0.0 and not lora  # with LoRA TRL uses the base model with adapters off
    info["trainable_b"] = A / 1e9

    # -- model states on each training GPU (bytes) ---------------------------------------------
    z3 = k.zero == 3
    shard = n if k.zero >= 1 else 1
    if z3:
        weights = 0.0 if k.offload_params else 2.0 * P / n
    else:
        weights = 2.0 * P
    if k.offload_opt:
        grads_opt = (0.5 * 2.0 * A / n) if z3 else (0.25 * 2.0 * A / n)  # staging for CPU copy
    elif k.zero == 0:
        grads_opt = 14.0 * A  # bf16 grads + fp32 master, m, v (weights above)
    elif k.zero == 1:
        grads_opt = 2.0 * A + 16.0 * A / n  # full bf16 grads; fp32 master, m, v, grad partition
    elif k.zero == 2:
        grads_opt = 14.0 * A / n  # bf16 grad partition + fp32 master, m, v
    else:
        grads_opt = 14.0 * A / n
    if lora:  # only the adapters train: tiny states
        grads_opt = 16.0 * A / (n if z3 else 1)
    # buckets and gathered working sets: what the textbook formulas leave out or round off
    if z3:
        live = 2.0 * (m.largest_module + 2.0 * m.layer_linear) * (1.15 if k.offload_params else 1.0)
        buffers = live + 2.0 * 0.9 * m.hidden**2 * 2
    else:
        buffers = 2.0 * 2.0 * min(5e8, max(m.hidden**2, 2e7)) + (0.0 if k.zero else 2.0 * A * 0.04)
    ref_w = (0.0 if k.offload_params else 2.0 * P / n) if (ref and z3) else (2.0 * P if ref else 0.0)
    states = (weights + grads_opt + buffers + ref_w) * 1.012  # flat-buffer padding/alignment

    # non-PyTorch memory: CUDA context, NCCL communicators, cuBLAS workspaces (hidden)
    ctx = (0.52 if g.tflops >= 700 else 0.44) * GIB
    if sc.gpus > 1:
        ctx += (0.21 + 0.043 * sc.gpus) * GIB
    if k.zero >= 1:
        ctx += 0.11 * GIB
    rank0_extra = 0.27 * GIB + rng.uniform(0.0, 0.1) * GIB

    # -- dynamic training memory for one micro-batch ---------------------------------------------
    b, C, h = k.pdbs, sc.completion, m.hidden
    qd, kvd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    layer_tok = 2.0 * (7 * h + 2 * kvd + 4 * m.inter) + 4.0 * m.heads  # stored per token per layer
    if k.gc:
        acts = m.layers * s_len * b * h * 2.0 + s_len * b * layer_tok * 1.0
    else:
        acts = m.layers * s_len * b * layer_tok
    if k.liger:
        logits = 2.0 * b * C * h * 4.0 + min(b * C, 1024) * m.vocab * 4.0 * 2.0
    else:
        logits = 5.8 * b * C * m.vocab  # fp32 upcast of bf16 logits, ~2.9x the bf16 tensor
    frag = 1.03 + 0.022 * math.log2(b) + (0.025 if not k.gc else 0.0) + rng.uniform(-0.006, 0.006)
    dyn = (acts + logits) * frag
    info["logits_gib"] = logits / GIB
    info["acts_gib"] = acts / GIB
    info["states_gib"] = states / GIB

    # -- vLLM engine ---------------------------------------------------------------------------
    kvb_gpu = m.kv_bytes_per_token / min(k.tp, m.kv_heads)  # KV heads shard across TP ranks
    w_vllm = 2.0 * P / k.tp
    vllm_outside = 0.15 * GIB  # allocations outside the budget (hidden)
    vllm_train = vllm_gen = 0.0  # vLLM bytes on a training GPU in each phase
    kv_tokens = 0
    conc = 0
    # TRL sizes the colocated engine for exactly one generation batch; vllm-serve keeps vLLM's 256
    max_num_seqs = 256 if k.server else k.pdbs * k.tp * k.spg
    batched_tokens = 8192 if k.server else 4096
    if k.use_vllm:
        budget = k.util * cap * GIB
        act_peak = (
            batched_tokens * (2 * m.inter + 4 * h) * 2.0 / k.tp
            + min(max_num_seqs, batched_tokens) * m.vocab * 4.0
        ) * 1.1
        graphs = rng.uniform(0.25, 0.6) * GIB
        kv_mem = budget - w_vllm - act_peak - graphs
        info.update(
            vllm_budget_gib=budget / GIB,
            vllm_weights_gib=w_vllm / GIB,
            kv_cache_gib=max(kv_mem, 0.0) / GIB,
            kv_avail_gib=kv_mem / GIB,
            graphs_gib=graphs / GIB,
            max_model_len=sc.max_model_len,
        )
        if kv_mem > 0:
            kv_tokens = int(kv_mem // (16 * kvb_gpu)) * 16
            info["gpu_blocks"] = kv_tokens // 16
            info["kv_tokens"] = kv_tokens
            info["max_concurrency"] = kv_tokens / sc.max_model_len
        conc = min(max_num_seqs, int(kv_tokens // s_len))
        info["concurrency"] = conc
        if not k.server:
            vllm_gen = budget + vllm_outside
            # TRL puts the engine to sleep at level 2: weights and KV cache are unmapped while the
            # trainer works; the CUDA-graph pool and a little more stay.
            vllm_train = (graphs + 0.3 * GIB + vllm_outside) if k.sleep else vllm_gen

    # -- start-up time pieces ------------------------------------------------------------------
    t_load = t_import + 2.0 + 2.0 * P / (1.8e9) * (2.0 if ref else 1.0) * rng.uniform(0.85, 1.2)
    t_ds = (
        2.0
        + (4.0 + 0.6 * P / 1e9 if z3 else 1.0)
        + (16.0 * A / 5e9 if k.offload_opt else 0.0)
        + (2.0 * P / 5e9 if k.offload_params else 0.0)
    )
    t_vllm = (
        (6.0 + 2.0 * P / k.tp / 2.5e9 + 4.0 + rng.uniform(10.0, 28.0) + (2.0 if k.sleep else 0.0))
        if k.use_vllm
        else 0.0
    )
    info["phases"] = {"import": t_import, "load": t_load - t_import, "deepspeed": t_ds, "vllm": t_vllm}

    # host memory (hidden buffer factors; DeepSpeed's CPUAdam creates m and v lazily at step 1)
    host_base = sc.gpus * (2.8 + (1.2 if k.use_vllm and not k.server else 0.0)) * GIB + 1.5 * GIB
    if k.server:
        host_base += 3.5 * GIB
    host_init = host_base
    host_step1 = host_base
    if k.offload_opt:
        host_init += (4.0 * A + 4.0 * A) * 1.06 + sc.gpus * 0.5 * GIB  # fp32 master + grads, pinned
        host_step1 = host_init + 8.0 * A * 1.02  # Adam m and v
    if k.offload_params:
        extra = 2.0 * P * 1.1 + (2.0 * P * 1.1 if ref else 0.0)
        host_init += extra
        host_step1 += extra
    host_limit = sc.host_gib * GIB * 0.94 - 3.0 * GIB
    info.update(
        host_init_gib=host_init / GIB, host_need_gib=host_step1 / GIB, host_limit_gib=host_limit / GIB
    )

    startup_states = ctx + states + rank0_extra
    if startup_states > cap * GIB:
        # DeepSpeed allocates its fp32 partitions in deepspeed.initialize: dies before training
        info["oom"] = oom_numbers(
            rng,
            cap,
            startup_states,
            alloc=min(4.0 * A / shard, startup_states * 0.5),
            non_torch=ctx,
            unalloc=0.05 * GIB,
        )
        info["oom_where"] = "deepspeed_init"
        return result(t_load + t_ds * 0.6, Failure("cuda", 0, "cuda_oom"), startup_peak=cap)
    if host_init > host_limit:
        return result(t_load + t_ds * 0.8, Failure("host", 0, "sigkill"), startup_peak=startup_states / GIB)

    if k.use_vllm:
        free = cap * GIB - (0.0 if k.server else startup_states)
        budget = k.util * cap * GIB
        if budget > free:
            info["free_gib"] = free / GIB
            return result(
                t_load + t_ds + 6.0,
                Failure("vllm_startup", 0, "vllm_free_memory"),
                startup_peak=startup_states / GIB,
            )
        kv_need = sc.max_model_len * kvb_gpu
        if kv_mem <= 0:
            return result(
                t_load + t_ds + t_vllm * 0.5,
                Failure("vllm_kv", 0, "vllm_no_cache_blocks"),
                startup_peak=(startup_states + budget) / GIB,
            )
        if kv_mem < kv_need:
            info["kv_need_gib"] = kv_need / GIB
            info["est_max_len"] = int(kv_mem // kvb_gpu) // 16 * 16
            return result(
                t_load + t_ds + t_vllm * 0.5,
                Failure("vllm_kv", 0, "vllm_kv_max_seq"),
                startup_peak=(startup_states + budget) / GIB,
            )
    startup_s = t_load + t_ds + t_vllm + 2.0
    startup_peak = (startup_states + vllm_gen) / GIB

    # -- per-step memory --------------------------------------------------------------------------
    # training-phase peak on the worst GPU; generation phase with sleep mode wakes the engine
    train_phase = ctx + rank0_extra + states + dyn + vllm_train
    if not k.use_vllm:
        seqs_gen = k.pdbs * k.spg
        gathered = 2.0 * P * (1 - 1 / n) if z3 else 0.0
        hf_kv = seqs_gen * s_len * m.kv_bytes_per_token + seqs_gen * m.vocab * 4.0 * 3
        gen_phase = ctx + rank0_extra + states + gathered + hf_kv
    elif k.sleep:
        gen_phase = ctx + rank0_extra + states + 0.4 * GIB + 0.06 * dyn + vllm_gen
    else:
        gen_phase = 0.0
    creep_max = rng.uniform(0.025, 0.045) * (states + dyn) * (0.35 if k.empty_cache else 1.0)
    tau = rng.uniform(1.6, 2.6)
    mem_offset = rng.gauss(0.0, 0.0025 * cap) * GIB
    server_peak = (ctx + k.util * cap * GIB + vllm_outside) if k.server else 0.0
    info["dyn_gib"] = dyn / GIB

    # -- per-step time ------------------------------------------------------------------------
    tfl = g.tflops * 1e12
    bw = g.bw * 1e12
    link = g.link * 1e9 * 0.72
    pcie = (45e9 if g.tflops >= 700 else 22e9) * (0.85 if n > 4 else 1.0)

    # generation (one engine = tp GPUs; colocate: n/tp engines in parallel, server: vllm_dp engines)
    if k.server:
        seqs_engine = math.ceil(n * k.pdbs * k.spg / k.vllm_dp)
    else:
        seqs_engine = k.pdbs * k.spg * (k.tp if k.use_vllm else 1)
    gen_s = generation_time(sc, m, k, g, seqs_engine, conc, P)
    # weight sync trainer -> vLLM, once per generation
    if not k.use_vllm:
        sync_s = (2.0 * P * (1 - 1 / n) / link + 0.3) if z3 else 0.0
    elif k.server:
        sync_s = 2.0 * P / (link * 0.6) + m.n_tensors * 0.0022 + 0.5
    else:
        sync_s = (
            m.n_tensors * (0.008 if z3 else 0.0012)
            + 2.0 * P / (bw * 0.5)
            + (2.0 * P * (1 - 1 / n) / link if z3 and n > 1 else 0.0)
            + (2.0 * P / n / pcie if k.offload_params else 0.0)
            + (0.6 if lora else 0.0)
        )
    if k.sleep:
        sync_s += 1.6 + 0.02 * k.util * cap  # wake_up (re-allocate KV, reset caches) + sleep
    if k.server:
        sync_s += 0.35  # HTTP round trips

    # training: one micro-batch
    T = b * s_len
    fwd = 2.0 * m.layers * m.layer_linear * T + 2.0 * h * m.vocab * b * C + 2.0 * b * s_len**2 * qd * m.layers
    passes = (
        1.0
        + (2.0 if not lora else 1.1)
        + (1.0 if k.gc else 0.0)
        + (1.0 if ref else 0.0)
        + (1.0 if k.spg > k.ga else 0.0)
    )
    mfu = (0.50 if g.tflops < 700 else 0.42) * (T / (T + 1100.0)) * (h / (h + 500.0))
    compute = fwd * passes / (tfl * mfu) * (1.04 if k.liger else 1.0)
    mb = compute + 0.02
    # where a micro-batch's time goes, for the trainer's utilization timeline (gpu.csv): kernels,
    # per-module hooks (host-side), exposed communication, PCIe transfers of offload
    parts = {"compute": compute, "hooks": 0.02, "comm": 0.0, "pcie": 0.0}
    # ZeRO-3 gathers every layer's weights in forward, recompute and backward (and for the
    # reference model), then reduce-scatters the gradients; hooks cost per module and pass
    hook_passes = 2 + (1 if k.gc else 0) + (1 if ref else 0)
    if z3:
        parts["hooks"] += hook_passes * m.n_modules * 0.00022 * (1.3 if k.offload_params else 1.0)
        mb += hook_passes * m.n_modules * 0.00022 * (1.3 if k.offload_params else 1.0)
        if n > 1:
            comm = (hook_passes * 2.0 * P + 2.0 * A) * (1 - 1 / n) / link
            parts["comm"] += max(comm - 0.7 * compute, 0.12 * comm)
            mb += max(comm - 0.7 * compute, 0.12 * comm)
    elif k.zero == 2 and n > 1:
        comm = 2.0 * A * (1 - 1 / n) / link
        parts["comm"] += max(comm - 0.6 * compute, 0.1 * comm)
        mb += max(comm - 0.6 * compute, 0.1 * comm)
    if k.offload_opt:
        parts["pcie"] += 4.0 * A / n / pcie + 0.04
        mb += 4.0 * A / n / pcie + 0.04  # fp32 gradient partitions to pinned host memory
    if k.offload_params:
        parts["pcie"] += hook_passes * (2.0 * P / n / pcie + m.n_modules * 0.0004)
        mb += hook_passes * (2.0 * P / n / pcie + m.n_modules * 0.0004)
    # optimizer step
    if k.offload_opt:
        opt = A / 1.1e9 + 2.0 * A / n / pcie + 0.4  # DeepSpeedCPUAdam shares the host's cores
    else:
        opt = 16.0 * A / shard * 2.0 / (bw * 0.6) + 0.08
    if n > 1 and k.zero <= 1:
        opt += 2.0 * 2.0 * A * (1 - 1 / n) / link
    if n > 1 and k.zero in (1, 2):
        opt += 2.0 * A * (1 - 1 / n) / link * 0.8
    misc = 0.12 + 0.0015 * k.pdbs * k.ga + (0.05 if k.empty_cache else 0.0)
    train_s = k.ga * mb + opt
    info.update(
        gen_s=gen_s,
        sync_s=sync_s,
        micro_batch_s=mb,
        optimizer_s=opt,
        misc_s=misc,
        micro_batch_parts=parts,
        wake_s=(1.6 + 0.02 * k.util * cap) if k.sleep else 0.0,
    )

    run_factor = math.exp(rng.gauss(0.0, 0.03))
    times: list[float] = []
    gens: list[float] = []
    trains: list[float] = []
    peaks: list[float] = []
    failure: Failure | None = None
    fail_after = 0.0
    for step in range(1, sc.max_steps + 1):
        n_gens = sum(1 for i in range((step - 1) * k.ga, step * k.ga) if i % k.spg == 0)
        g_t = n_gens * (gen_s + sync_s)
        t_t = train_s + misc
        noise = run_factor * math.exp(rng.gauss(0.0, 0.02))
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
        # host: CPUAdam allocates its moments in the first optimizer step
        if step == 1 and host_step1 > host_limit:
            failure, fail_after = Failure("host", 1, "sigkill"), g_t + t_t * 0.97
            break
        if gp_peak > cap * GIB and n_gens:
            kind = "cumem_oom" if k.sleep else "cuda_oom"
            info["oom"] = oom_numbers(
                rng,
                cap,
                gp_peak,
                alloc=(k.util * cap * GIB - w_vllm) * 0.5
                if k.sleep
                else seqs_engine * s_len * m.kv_bytes_per_token,
                non_torch=ctx + (vllm_gen if k.sleep else 0.0),
                unalloc=0.06 * dyn + creep,
            )
            info["oom_where"] = "generation"
            failure, fail_after = Failure("cuda", step, kind), g_t * 0.1
            break
        if tp_peak > cap * GIB:
            alloc = (
                (b * C * m.vocab * 4.0) if (logits >= acts and not k.liger) else s_len * b * m.inter * 2.0 * 2
            )
            info["oom"] = oom_numbers(
                rng,
                cap,
                tp_peak,
                alloc=alloc,
                non_torch=ctx + (vllm_train if k.sleep else vllm_outside),
                unalloc=(frag - 1.0) * (acts + logits) + creep,
            )
            info["oom_where"] = "logits" if (logits >= acts and not k.liger) else "layer"
            failure, fail_after = Failure("cuda", step, "cuda_oom"), g_t + min(t_t, mb * 1.2)
            break
        peak = max(tp_peak, gp_peak, server_peak)
        times.append(g_t + t_t)
        gens.append(g_t)
        trains.append(t_t)
        peaks.append(peak / GIB)
    return result(startup_s, failure, fail_after, (times, gens, trains, peaks), startup_peak)
