"""The CUDA out-of-memory tracebacks of the fake GRPO trainer, and the NCCL watchdog timeout.

Where the trainer ran out decides the frames: DeepSpeed's initialisation (fp32 partitions), the
generation (transformers' generate or vLLM's wake-up), or the training step (the logits or a
decoder layer). A transient crash is torch's NCCL watchdog taking the process down: the text of
``tests/data/logs/multirank_cuda_oom_then_nccl_watchdog.log`` without the OOM that caused it there.
"""

from __future__ import annotations

from typing import Any

from autotune.sim.error_frames import SCRIPT, SITE, cuda_oom_message, frame, model_type, traceback
from autotune.sim.landscape import Scenario, TrialTruth


def _calls() -> list[str]:
    """torch's two frames of every module call."""
    torch_mod = f"{SITE}/torch/nn/modules/module.py"
    return [
        frame(torch_mod, 1773, "_wrapped_call_impl", "return self._call_impl(*args, **kwargs)"),
        frame(torch_mod, 1784, "_call_impl", "return forward_call(*args, **kwargs)"),
    ]


def _train_frames() -> list[str]:
    return [
        frame(SCRIPT, 66, "<module>", "trainer.train()"),
        frame(f"{SITE}/transformers/trainer.py", 2197, "train", "return inner_training_loop("),
    ]


def _cumem_text() -> str:
    """vLLM's sleep-mode allocator failing to map the KV cache back at wake-up."""
    train = _train_frames()
    frames = train + [
        frame(
            f"{SITE}/transformers/trainer.py",
            2500,
            "_inner_training_loop",
            "batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches, "
            "args.device)",
        ),
        frame(
            f"{SITE}/trl/trainer/grpo_trainer.py",
            1468,
            "_prepare_inputs",
            "generation_batch = self._generate_and_score_completions(generation_batch)",
        ),
        frame(
            f"{SITE}/trl/generation/vllm_generation.py",
            590,
            "generate",
            'self.llm.wake_up(tags=["kv_cache"])',
        ),
        frame(f"{SITE}/vllm/device_allocator/cumem.py", 230, "wake_up", "create_and_map(handle)"),
    ]
    return traceback(
        frames, "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62"
    )


def _deepspeed_frames(zero: int) -> list[str]:
    """deepspeed.initialize allocating its fp32 partitions."""
    train = _train_frames()
    ds_file = "zero/stage3.py" if zero == 3 else ("zero/stage_1_and_2.py" if zero else "bf16_optimizer.py")
    frames = train + [
        frame(
            f"{SITE}/transformers/trainer.py",
            2347,
            "_inner_training_loop",
            "model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)",
        ),
        frame(
            f"{SITE}/accelerate/accelerator.py",
            1512,
            "prepare",
            "result = self._prepare_deepspeed(*args)",
        ),
        frame(
            f"{SITE}/accelerate/accelerator.py",
            2135,
            "_prepare_deepspeed",
            "engine, optimizer, _, lr_scheduler = ds_initialize(**kwargs)",
        ),
        frame(f"{SITE}/deepspeed/__init__.py", 203, "initialize", "engine = DeepSpeedEngine("),
        frame(
            f"{SITE}/deepspeed/runtime/engine.py",
            352,
            "__init__",
            "self._configure_optimizer(optimizer, model_parameters)",
        ),
        frame(
            f"{SITE}/deepspeed/runtime/{ds_file}",
            412,
            "__init__",
            "self.single_partition_of_fp32_groups.append(weights_partition.float().detach())",
        ),
    ]
    return frames


def _generation_frames(model_py: str) -> list[str]:
    """transformers' generate running the LM head."""
    train, call = _train_frames(), _calls()
    frames = (
        train
        + [
            frame(
                f"{SITE}/trl/trainer/grpo_trainer.py",
                1468,
                "_prepare_inputs",
                "generation_batch = self._generate_and_score_completions(generation_batch)",
            ),
            frame(f"{SITE}/transformers/generation/utils.py", 2539, "generate", "result = decoding_method("),
            frame(
                f"{SITE}/transformers/generation/utils.py",
                2790,
                "_sample",
                "outputs = self(**model_inputs, return_dict=True)",
            ),
        ]
        + call
        + [frame(model_py, 452, "forward", "logits = self.lm_head(hidden_states[:, slice_indices, :])")]
    )
    return frames


def _training_frames(model_py: str, where: str) -> list[str]:
    """GRPO's loss: the policy forward through DeepSpeed, then the logits or a decoder layer."""
    train, call = _train_frames(), _calls()
    frames = (
        train
        + [
            frame(
                f"{SITE}/transformers/trainer.py",
                2561,
                "_inner_training_loop",
                "tr_loss_step = self.training_step(model, inputs, num_items_in_batch)",
            ),
            frame(
                f"{SITE}/trl/trainer/grpo_trainer.py",
                1502,
                "training_step",
                "output = super().training_step(model, inputs, num_items_in_batch)",
            ),
            frame(
                f"{SITE}/transformers/trainer.py",
                3791,
                "training_step",
                "loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)",
            ),
            frame(
                f"{SITE}/trl/trainer/grpo_trainer.py",
                2205,
                "compute_loss",
                "return self._compute_loss(model, inputs)",
            ),
            frame(
                f"{SITE}/trl/trainer/grpo_trainer.py",
                2228,
                "_compute_loss",
                "per_token_logps, entropies = self._get_per_token_logps_and_entropies(",
            ),
            frame(
                f"{SITE}/trl/trainer/grpo_trainer.py",
                1003,
                "_get_per_token_logps_and_entropies",
                "logits = model(**model_inputs).logits",
            ),
        ]
        + call
        + [
            frame(f"{SITE}/deepspeed/utils/nvtx.py", 20, "wrapped_fn", "ret_val = func(*args, **kwargs)"),
            frame(
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
            frame(
                f"{SITE}/transformers/utils/generic.py",
                918,
                "wrapper",
                "output = func(self, *args, **kwargs)",
            ),
            frame(model_py, 452, "forward", "logits = self.lm_head(hidden_states[:, slice_indices, :])"),
            frame(
                f"{SITE}/trl/trainer/utils.py",
                1611,
                "selective_log_softmax",
                "logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])",
            ),
        ]
    else:
        frames += (
            [
                frame(model_py, 384, "forward", "hidden_states = decoder_layer("),
                frame(
                    f"{SITE}/transformers/modeling_layers.py",
                    94,
                    "__call__",
                    "return super().__call__(*args, **kwargs)",
                ),
            ]
            + call
            + [
                frame(model_py, 251, "forward", "hidden_states = self.mlp(hidden_states)"),
            ]
            + call
            + [
                frame(
                    model_py,
                    57,
                    "forward",
                    "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
                ),
            ]
        )
    return frames


def cuda_text(spec: dict[str, Any], sc: Scenario, truth: TrialTruth) -> str:
    """The traceback of a CUDA OOM, its frames chosen by where the trainer ran out."""
    info, f = truth.info, truth.failure
    assert f is not None
    if f.message_kind == "cumem_oom":
        return _cumem_text()
    where = info.get("oom_where", "logits")
    mtype = model_type(spec.get("model_config") or {})
    model_py = f"{SITE}/transformers/models/{mtype}/modeling_{mtype}.py"
    if where == "deepspeed_init":
        frames = _deepspeed_frames(sc.k.zero)
    elif where == "generation":
        frames = _generation_frames(model_py)
    else:
        frames = _training_frames(model_py, where)
    return traceback(frames, "torch.OutOfMemoryError: " + cuda_oom_message(info.get("oom") or {}))


def nccl_timeout_text(seq: int, world: int, rank: int = 1) -> str:
    """torch's NCCL watchdog taking a rank down after a collective hung (ProcessGroupNCCL.cpp),
    then torchrun reporting the failed child: a crash that says nothing about memory."""
    ts = "E0312 14:13:03.433063423"
    work = (
        f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
        "ran for 600088 milliseconds before timing out."
    )
    pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {rank}]"
    return (
        f"[rank{rank}]:[{ts} ProcessGroupNCCL.cpp:629] [Rank {rank}] Watchdog caught collective "
        f"operation timeout: {work}\n"
        f"[rank{rank}]:[{ts} ProcessGroupNCCL.cpp:2168] {pg}  failure detected by watchdog at work "
        f"sequence id: {seq} PG status: last enqueued work: {seq}, last completed work: {seq - 1}\n"
        f"[rank{rank}]:[{ts} ProcessGroupNCCL.cpp:681] [Rank {rank}] Some NCCL operations have failed "
        "or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might "
        "run on corrupted/incomplete data.\n"
        f"[rank{rank}]:[{ts} ProcessGroupNCCL.cpp:695] [Rank {rank}] To avoid data inconsistency, we "
        "are taking the entire process down.\n"
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        f"  what():  {pg} Process group watchdog thread terminated with exception: [Rank {rank}] "
        f"Watchdog caught collective operation timeout: {work}\n"
        f"E0312 14:13:05.642000 90211 torch/distributed/elastic/multiprocessing/api.py:869] failed "
        f"(exitcode: -6) local_rank: {rank} (pid: 90234) of binary: /usr/bin/python3\n"
        f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: grpo_trial.py FAILED "
        f"(world size {world}, rank {rank}: exitcode -6, Signal 6 (SIGABRT))\n"
    )
