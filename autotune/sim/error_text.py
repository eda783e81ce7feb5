"""The texts the fake GRPO trainer prints that must look like the real ones, and the failure texts.

Why imitate so closely: autotune's outcome classifier and monitor read real TRL / DeepSpeed / vLLM /
PyTorch output, so a rehearsal exercises them only if the tracebacks and messages carry the same
wording and numbers (sizes in PyTorch's binary units, vLLM's and DeepSpeed's timestamp formats).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from autotune.sim.landscape import GIB, Scenario, TrialTruth

SITE = "/usr/local/lib/python3.11/site-packages"
SCRIPT = "/workspace/grpo_trial.py"


def format_size(nbytes: float) -> str:
    """Sizes the way PyTorch's allocator messages print them (two decimals, binary units)."""
    if nbytes < 1024:
        return f"{nbytes:.2f} bytes" if nbytes != int(nbytes) else f"{int(nbytes)} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20)):
        if nbytes < scale * 1024:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / GIB:.2f} GiB"


def vllm_ts() -> str:
    return datetime.now().strftime("%m-%d %H:%M:%S")


def ds_ts() -> str:
    now = datetime.now()
    return now.strftime("%Y-%m-%d %H:%M:%S,") + f"{now.microsecond // 1000:03d}"


def _model_type(model_cfg: dict) -> str:
    """transformers' module name for the model, for the traceback frames."""
    return str(model_cfg.get("model_type") or "llama").replace("-", "_")


def _frame(path: str, line: int, func: str, code: str) -> str:
    return f'  File "{path}", line {line}, in {func}\n    {code}\n'


def _traceback(frames: list[str], last: str) -> str:
    return "Traceback (most recent call last):\n" + "".join(frames) + last + "\n"


def cuda_oom_message(o: dict[str, float]) -> str:
    """PyTorch's allocator message with the landscape's numbers (torch >= 2.2 wording)."""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(o['tried_gib'] * GIB)}. "
        f"GPU {int(o.get('gpu', 0))} has a total capacity of {format_size(o['capacity_gib'] * GIB)} "
        f"of which {format_size(o['free_gib'] * GIB)} is free. Including non-PyTorch memory, this "
        f"process has {format_size(o['in_use_gib'] * GIB)} memory in use. Of the allocated memory "
        f"{format_size(o['allocated_gib'] * GIB)} is allocated by PyTorch, and "
        f"{format_size(o['unallocated_gib'] * GIB)} is reserved by PyTorch but unallocated. If reserved "
        "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        "avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def failure_text(spec: dict[str, Any], sc: Scenario, truth: TrialTruth) -> str:
    """The error text (stderr) of a trial that dies with a traceback: every failure kind but ``host``,
    which the kernel's OOM killer ends without a word."""
    f = truth.failure
    assert f is not None
    return {
        "invalid": lambda: _invalid_text(sc, truth),
        "vllm_startup": lambda: _vllm_startup_text(sc, truth),
        "vllm_kv": lambda: _vllm_kv_text(truth),
        "cuda": lambda: _cuda_text(spec, sc, truth),
    }[f.kind]()


def _trainer_init_frames() -> list[str]:
    return [
        _frame(SCRIPT, 57, "<module>", "trainer = GRPOTrainer("),
        _frame(
            f"{SITE}/trl/trainer/grpo_trainer.py", 1101, "__init__", "self.vllm_generation = VLLMGeneration("
        ),
        _frame(f"{SITE}/trl/generation/vllm_generation.py", 345, "__init__", "self.llm = LLM("),
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
        return _traceback(
            _trainer_init_frames()[:2]
            + [_frame(f"{SITE}/trl/generation/vllm_generation.py", 315, "__init__", "raise ValueError(")],
            f"ValueError: tensor_parallel_size ({k.tp}) must divide world size ({sc.gpus}) evenly.",
        )
    else:
        msg = (
            f"vllm_mode='server' needs GPUs left for training: {sc.gpus} GPUs, "
            f"{k.tp * k.vllm_dp} of them serve vLLM."
        )
    return _traceback(
        [
            _frame(SCRIPT, 41, "<module>", "args = GRPOConfig("),
            _frame("<string>", 172, "__init__", ""),
            _frame(f"{SITE}/trl/trainer/grpo_config.py", 1131, "__post_init__", "raise ValueError("),
        ],
        f"ValueError: {msg}",
    )


def _engine_failed(root: str, frames: list[str]) -> str:
    """vLLM V1: the engine core logs the root cause, the front end raises a RuntimeError."""
    core = f"ERROR {vllm_ts()} [core.py:718] EngineCore failed to start.\n" + _traceback(
        [
            _frame(
                f"{SITE}/vllm/v1/engine/core.py",
                709,
                "run_engine_core",
                "engine_core = EngineCoreProc(*args, **kwargs)",
            ),
            _frame(
                f"{SITE}/vllm/v1/engine/core.py",
                505,
                "__init__",
                "super().__init__(vllm_config, executor_class, log_stats,",
            ),
            *frames,
        ],
        root,
    )
    front = _traceback(
        _trainer_init_frames()
        + [
            _frame(
                f"{SITE}/vllm/entrypoints/llm.py",
                285,
                "__init__",
                "self.llm_engine = LLMEngine.from_engine_args(",
            ),
            _frame(
                f"{SITE}/vllm/v1/engine/core_client.py",
                549,
                "__init__",
                "with launch_core_engines(vllm_config, executor_class,",
            ),
            _frame(
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
            _frame(
                f"{SITE}/vllm/v1/worker/gpu_worker.py",
                188,
                "init_device",
                "self.requested_memory = request_memory(init_snapshot, self.cache_config)",
            ),
            _frame(f"{SITE}/vllm/utils/mem_utils.py", 151, "request_memory", "raise ValueError("),
        ],
    )


def _vllm_kv_text(truth: TrialTruth) -> str:
    info, f = truth.info, truth.failure
    assert f is not None
    frames = [
        _frame(f"{SITE}/vllm/v1/engine/core.py", 94, "__init__", "self._initialize_kv_caches(vllm_config)"),
        _frame(
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
            _frame(
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
            _frame(
                f"{SITE}/vllm/v1/core/kv_cache_utils.py",
                716,
                "check_enough_kv_cache_memory",
                "raise ValueError(",
            )
        )
    return _engine_failed(msg, frames)


def _cuda_text(spec: dict[str, Any], sc: Scenario, truth: TrialTruth) -> str:
    info, f = truth.info, truth.failure
    assert f is not None
    o = info.get("oom") or {}
    where = info.get("oom_where", "logits")
    mtype = _model_type(spec.get("model_config") or {})
    model_py = f"{SITE}/transformers/models/{mtype}/modeling_{mtype}.py"
    torch_mod = f"{SITE}/torch/nn/modules/module.py"
    call = [
        _frame(torch_mod, 1773, "_wrapped_call_impl", "return self._call_impl(*args, **kwargs)"),
        _frame(torch_mod, 1784, "_call_impl", "return forward_call(*args, **kwargs)"),
    ]
    train = [
        _frame(SCRIPT, 66, "<module>", "trainer.train()"),
        _frame(f"{SITE}/transformers/trainer.py", 2197, "train", "return inner_training_loop("),
    ]
    if f.message_kind == "cumem_oom":
        frames = train + [
            _frame(
                f"{SITE}/transformers/trainer.py",
                2500,
                "_inner_training_loop",
                "batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches, "
                "args.device)",
            ),
            _frame(
                f"{SITE}/trl/trainer/grpo_trainer.py",
                1468,
                "_prepare_inputs",
                "generation_batch = self._generate_and_score_completions(generation_batch)",
            ),
            _frame(
                f"{SITE}/trl/generation/vllm_generation.py",
                590,
                "generate",
                'self.llm.wake_up(tags=["kv_cache"])',
            ),
            _frame(f"{SITE}/vllm/device_allocator/cumem.py", 230, "wake_up", "create_and_map(handle)"),
        ]
        return _traceback(
            frames, "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62"
        )
    if where == "deepspeed_init":
        zero = sc.k.zero
        ds_file = (
            "zero/stage3.py" if zero == 3 else ("zero/stage_1_and_2.py" if zero else "bf16_optimizer.py")
        )
        frames = train + [
            _frame(
                f"{SITE}/transformers/trainer.py",
                2347,
                "_inner_training_loop",
                "model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)",
            ),
            _frame(
                f"{SITE}/accelerate/accelerator.py",
                1512,
                "prepare",
                "result = self._prepare_deepspeed(*args)",
            ),
            _frame(
                f"{SITE}/accelerate/accelerator.py",
                2135,
                "_prepare_deepspeed",
                "engine, optimizer, _, lr_scheduler = ds_initialize(**kwargs)",
            ),
            _frame(f"{SITE}/deepspeed/__init__.py", 203, "initialize", "engine = DeepSpeedEngine("),
            _frame(
                f"{SITE}/deepspeed/runtime/engine.py",
                352,
                "__init__",
                "self._configure_optimizer(optimizer, model_parameters)",
            ),
            _frame(
                f"{SITE}/deepspeed/runtime/{ds_file}",
                412,
                "__init__",
                "self.single_partition_of_fp32_groups.append(weights_partition.float().detach())",
            ),
        ]
    elif where == "generation":
        frames = (
            train
            + [
                _frame(
                    f"{SITE}/trl/trainer/grpo_trainer.py",
                    1468,
                    "_prepare_inputs",
                    "generation_batch = self._generate_and_score_completions(generation_batch)",
                ),
                _frame(
                    f"{SITE}/transformers/generation/utils.py", 2539, "generate", "result = decoding_method("
                ),
                _frame(
                    f"{SITE}/transformers/generation/utils.py",
                    2790,
                    "_sample",
                    "outputs = self(**model_inputs, return_dict=True)",
                ),
            ]
            + call
            + [_frame(model_py, 452, "forward", "logits = self.lm_head(hidden_states[:, slice_indices, :])")]
        )
    else:
        frames = (
            train
            + [
                _frame(
                    f"{SITE}/transformers/trainer.py",
                    2561,
                    "_inner_training_loop",
                    "tr_loss_step = self.training_step(model, inputs, num_items_in_batch)",
                ),
                _frame(
                    f"{SITE}/trl/trainer/grpo_trainer.py",
                    1502,
                    "training_step",
                    "output = super().training_step(model, inputs, num_items_in_batch)",
                ),
                _frame(
                    f"{SITE}/transformers/trainer.py",
                    3791,
                    "training_step",
                    "loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)",
                ),
                _frame(
                    f"{SITE}/trl/trainer/grpo_trainer.py",
                    2205,
                    "compute_loss",
                    "return self._compute_loss(model, inputs)",
                ),
                _frame(
                    f"{SITE}/trl/trainer/grpo_trainer.py",
                    2228,
                    "_compute_loss",
                    "per_token_logps, entropies = self._get_per_token_logps_and_entropies(",
                ),
                _frame(
                    f"{SITE}/trl/trainer/grpo_trainer.py",
                    1003,
                    "_get_per_token_logps_and_entropies",
                    "logits = model(**model_inputs).logits",
                ),
            ]
            + call
            + [
                _frame(
                    f"{SITE}/deepspeed/utils/nvtx.py", 20, "wrapped_fn", "ret_val = func(*args, **kwargs)"
                ),
                _frame(
                    f"{SITE}/deepspeed/runtime/engine.py",
                    2139,
                    "forward",
                    "loss = self.module(*inputs, **kwargs)",
                ),
            ]
            + call
        )
        if where == "logits":
            frames += [
                _frame(
                    f"{SITE}/transformers/utils/generic.py",
                    918,
                    "wrapper",
                    "output = func(self, *args, **kwargs)",
                ),
                _frame(model_py, 452, "forward", "logits = self.lm_head(hidden_states[:, slice_indices, :])"),
                _frame(
                    f"{SITE}/trl/trainer/utils.py",
                    1611,
                    "selective_log_softmax",
                    "logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])",
                ),
            ]
        else:
            frames += (
                [
                    _frame(model_py, 384, "forward", "hidden_states = decoder_layer("),
                    _frame(
                        f"{SITE}/transformers/modeling_layers.py",
                        94,
                        "__call__",
                        "return super().__call__(*args, **kwargs)",
                    ),
                ]
                + call
                + [
                    _frame(model_py, 251, "forward", "hidden_states = self.mlp(hidden_states)"),
                ]
                + call
                + [
                    _frame(
                        model_py,
                        57,
                        "forward",
                        "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
                    ),
                ]
            )
    return _traceback(frames, "torch.OutOfMemoryError: " + cuda_oom_message(o))
