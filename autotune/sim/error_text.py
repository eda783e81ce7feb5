"""The failure texts of the fake GRPO trainer: TRL's refusals, vLLM's start-up errors, and the
dispatch to the CUDA and NCCL texts (``error_cuda``), built from ``error_frames``' pieces.

Why imitate so closely: autotune's outcome classifier reads real TRL / DeepSpeed / vLLM / PyTorch
output, so a rehearsal exercises it only if the tracebacks carry the same wording and numbers.
"""

from __future__ import annotations

from typing import Any

from autotune.sim.error_cuda import cuda_text, nccl_timeout_text
from autotune.sim.error_frames import SCRIPT, SITE, frame, traceback, vllm_ts
from autotune.sim.landscape import Scenario, TrialTruth

# the names the trainer and tests import from here
__all__ = ["failure_text", "nccl_timeout_text"]


def failure_text(spec: dict[str, Any], sc: Scenario, truth: TrialTruth) -> str:
    """The error text (stderr) of a trial that dies with a traceback: every failure kind but ``host``,
    which the kernel's OOM killer ends without a word."""
    f = truth.failure
    assert f is not None
    return {
        "invalid": lambda: _invalid_text(sc, truth),
        "vllm_startup": lambda: _vllm_startup_text(sc, truth),
        "vllm_kv": lambda: _vllm_kv_text(truth),
        "cuda": lambda: cuda_text(spec, sc, truth),
        "transient": lambda: nccl_timeout_text(truth.info.get("nccl_seq", 1041), sc.gpus),
    }[f.kind]()


def _trainer_init_frames() -> list[str]:
    return [
        frame(SCRIPT, 57, "<module>", "trainer = GRPOTrainer("),
        frame(
            f"{SITE}/trl/trainer/grpo_trainer.py", 1101, "__init__", "self.vllm_generation = VLLMGeneration("
        ),
        frame(f"{SITE}/trl/generation/vllm_generation.py", 345, "__init__", "self.llm = LLM("),
    ]


def _invalid_text(sc: Scenario, truth: TrialTruth) -> str:
    info = truth.info
    k = sc.k
    why = info.get("invalid")
    n_train = info.get("n_train_gpus", sc.gpus)
    gen_batch = info.get("gen_batch", k.pdbs * n_train * k.spg)
    if why == "num_generations_lt2":
        msg = (
            "GRPO requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"{k.num_gen}, which is less than the minimum required."
        )
    elif why == "gen_batch_div_num_gen":
        msg = f"generation_batch_size ({gen_batch}) must be divisible by num_generations ({k.num_gen})."
    elif why == "gen_batch_div_global":
        msg = (
            f"generation_batch_size ({gen_batch}) must be divisible by the global batch size "
            f"({k.pdbs * n_train})."
        )
    elif why == "tp_divides_world":
        return traceback(
            _trainer_init_frames()[:2]
            + [frame(f"{SITE}/trl/generation/vllm_generation.py", 315, "__init__", "raise ValueError(")],
            f"ValueError: tensor_parallel_size ({k.tp}) must divide world size ({sc.gpus}) evenly.",
        )
    else:
        msg = (
            f"vllm_mode='server' needs GPUs left for training: {sc.gpus} GPUs, "
            f"{k.tp * k.vllm_dp} of them serve vLLM."
        )
    return traceback(
        [
            frame(SCRIPT, 41, "<module>", "args = GRPOConfig("),
            frame("<string>", 172, "__init__", ""),
            frame(f"{SITE}/trl/trainer/grpo_config.py", 1131, "__post_init__", "raise ValueError("),
        ],
        f"ValueError: {msg}",
    )


def _engine_failed(root: str, frames: list[str]) -> str:
    """vLLM V1: the engine core logs the root cause, the front end raises a RuntimeError."""
    core = f"ERROR {vllm_ts()} [core.py:718] EngineCore failed to start.\n" + traceback(
        [
            frame(
                f"{SITE}/vllm/v1/engine/core.py",
                709,
                "run_engine_core",
                "engine_core = EngineCoreProc(*args, **kwargs)",
            ),
            frame(
                f"{SITE}/vllm/v1/engine/core.py",
                505,
                "__init__",
                "super().__init__(vllm_config, executor_class, log_stats,",
            ),
            *frames,
        ],
        root,
    )
    front = traceback(
        _trainer_init_frames()
        + [
            frame(
                f"{SITE}/vllm/entrypoints/llm.py",
                285,
                "__init__",
                "self.llm_engine = LLMEngine.from_engine_args(",
            ),
            frame(
                f"{SITE}/vllm/v1/engine/core_client.py",
                549,
                "__init__",
                "with launch_core_engines(vllm_config, executor_class,",
            ),
            frame(
                f"{SITE}/vllm/v1/engine/utils.py",
                804,
                "wait_for_engine_startup",
                'raise RuntimeError("Engine core initialization failed. "',
            ),
        ],
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    )
    return core + front


def _vllm_startup_text(sc: Scenario, truth: TrialTruth) -> str:
    info, k, cap = truth.info, sc.k, truth.capacity_gib
    free = info.get("free_gib", 0.0)
    msg = (
        f"ValueError: Free memory on device ({free:.2f}/{cap:.2f} GiB) on startup is less than desired "
        f"GPU memory utilization ({k.util}, {k.util * cap:.2f} GiB). Decrease GPU memory utilization "
        "or reduce GPU memory used by other processes."
    )
    return _engine_failed(
        msg,
        [
            frame(
                f"{SITE}/vllm/v1/worker/gpu_worker.py",
                188,
                "init_device",
                "self.requested_memory = request_memory(init_snapshot, self.cache_config)",
            ),
            frame(f"{SITE}/vllm/utils/mem_utils.py", 151, "request_memory", "raise ValueError("),
        ],
    )


def _vllm_kv_text(truth: TrialTruth) -> str:
    info, f = truth.info, truth.failure
    assert f is not None
    frames = [
        frame(f"{SITE}/vllm/v1/engine/core.py", 94, "__init__", "self._initialize_kv_caches(vllm_config)"),
        frame(
            f"{SITE}/vllm/v1/engine/core.py",
            199,
            "_initialize_kv_caches",
            "kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs,",
        ),
    ]
    if f.message_kind == "vllm_no_cache_blocks":
        msg = (
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
        frames.append(
            frame(
                f"{SITE}/vllm/v1/core/kv_cache_utils.py",
                699,
                "check_enough_kv_cache_memory",
                'raise ValueError("No available memory for the cache blocks. "',
            )
        )
    else:
        mml = info.get("max_model_len", 0)
        msg = (
            f"ValueError: To serve at least one request with the models's max seq len ({mml}), "
            f"({info.get('kv_need_gib', 0.0):.2f} GiB KV cache is needed, which is larger than the "
            f"available KV cache memory ({info.get('kv_cache_gib', 0.0):.2f} GiB). Based on the "
            f"available memory, the estimated maximum model length is {info.get('est_max_len', 0)}. "
            "Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
            "the engine."
        )
        frames.append(
            frame(
                f"{SITE}/vllm/v1/core/kv_cache_utils.py",
                716,
                "check_enough_kv_cache_memory",
                "raise ValueError(",
            )
        )
    return _engine_failed(msg, frames)
