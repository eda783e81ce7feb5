"""One trial, end to end: read the spec, build everything, train, tear down; and the CLI.

``python -m autotune.worker --trial-spec FILE`` runs :func:`main` (see :mod:`autotune.worker`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from autotune.worker.callbacks import _GenerationTimer, make_metrics_callback
from autotune.worker.config import build_grpo_config
from autotune.worker.console import say
from autotune.worker.model import build_model, peft_config

__all__ = ["load_spec", "main", "run_trial"]


def run_trial(spec: dict[str, Any]) -> bool:
    """Build everything from ``spec`` and train ``spec['max_steps']`` optimizer steps; True when
    it ran as one process of several (its process group is torn down by then). A single process
    can hold a group of one too (accelerate's DeepSpeed launch, TRL's colocated vLLM): False."""
    import trl
    from trl import GRPOTrainer

    from autotune.worker.data import build_dataset, prompts_needed
    from autotune.worker.rewards import length_noise_reward
    from autotune.worker.tokenizer import load_tokenizer
    from autotune.worker.vision import build_processor, is_vision, report_vision, vision_dataset

    args = build_grpo_config(spec)
    model_info = spec["model"]
    own_path = model_info.get("path") if model_info.get("has_weights") else None
    tokenizer = load_tokenizer(model_info["config"], own_path)
    world = int(args.world_size)
    per_step = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * world
    rows = prompts_needed(per_step, int(args.num_generations), int(spec["max_steps"]))
    length, seed = int(spec["max_prompt_length"]), int(spec.get("seed", 0))
    image_tokens, images = int(spec.get("image_tokens") or 0), int(spec.get("images_per_prompt") or 0)
    processing_class = tokenizer
    if image_tokens and images and is_vision(model_info["config"]):
        # a VL trial: the processor tokenises the prompts and turns the images into patches
        processing_class = build_processor(tokenizer, model_info["config"], image_tokens, own_path)
        dataset = vision_dataset(
            processing_class, model_info["config"], length, image_tokens, images, rows, seed
        )
    else:
        image_tokens = images = 0
        dataset = build_dataset(tokenizer, length, rows, spec.get("dataset"), seed=seed)
    model = build_model(spec, args, tokenizer)
    if image_tokens:
        report_vision(model)

    timer = _GenerationTimer()
    metrics_file = os.environ.get("AUTOTUNE_METRICS_FILE")
    callback = make_metrics_callback(
        Path(metrics_file) if metrics_file else None,
        per_step,
        length + image_tokens * images + int(spec["max_completion_length"]),
        spec["device"],
        timer,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_noise_reward,
        args=args,
        train_dataset=dataset,
        processing_class=processing_class,
        callbacks=[callback],
        peft_config=peft_config(spec),
    )
    timer.wrap(trainer)
    trainer.add_callback(_engine_report(trainer))
    say(
        f"trial {spec.get('number', '?')}: trl {trl.__version__}, {world} process(es), "
        f"{per_step} completions/step, prompt {spec['max_prompt_length']}"
        f"{f' + {images} x {image_tokens} image' if image_tokens else ''} + completion "
        f"{spec['max_completion_length']} tokens, {spec['max_steps']} steps"
    )
    resume = (spec.get("production") or {}).get("resume_from_checkpoint")
    trainer.train(resume_from_checkpoint=resume)  # `autotune run` after an OOM: the newest checkpoint
    # tear the process group down before interpreter exit: gloo's threads otherwise race the
    # C++ destructors and a finished trial can die with SIGABRT ("terminate called without an
    # active exception"), which would read as a crash
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        several = dist.get_world_size() > 1
        dist.barrier()
        dist.destroy_process_group()
        return several
    return False


def _engine_report(trainer: Any) -> Any:
    """A callback that says once, at the first step, what really trains: DeepSpeed's engine (ZeRO
    stage, optimizer class, what is offloaded, the collective backend) or plain torch, so a trial's
    log shows that a ZeRO label was honoured."""
    from transformers import TrainerCallback

    class EngineReport(TrainerCallback):
        said = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.said or not state.is_world_process_zero:
                return
            self.said = True
            engine = getattr(trainer, "model_wrapped", None)
            if not getattr(trainer, "is_deepspeed_enabled", False) or not hasattr(
                engine, "zero_optimization_stage"
            ):
                say("engine: torch (no DeepSpeed)")
                return
            import deepspeed
            import torch.distributed as dist

            optimizer = getattr(engine, "optimizer", None)
            inner = getattr(optimizer, "optimizer", optimizer)
            say(
                f"engine: deepspeed {deepspeed.__version__}, ZeRO stage {engine.zero_optimization_stage()}, "
                f"optimizer {type(inner).__name__}, "
                f"offload optimizer={bool(engine.zero_offload_optimizer())} "
                f"params={bool(engine.zero_offload_param())}, backend {dist.get_backend()}, "
                f"world {dist.get_world_size()}"
            )

    return EngineReport()


def load_spec(path: Path) -> dict[str, Any]:
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(spec, dict) or spec.get("version") != 1:
        raise SystemExit(f"autotune.worker: {path} is not a version-1 trial spec")
    return spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autotune.worker",
        description="Run one autotune GRPO trial (written by the trl runner).",
    )
    parser.add_argument("--trial-spec", required=True, type=Path, help="trial_spec.json in the trial folder")
    ns = parser.parse_args(argv)
    if run_trial(load_spec(ns.trial_spec)) and argv is None:
        # one rank of several, trained and its group down: leave without the interpreter's teardown.
        # A finished rank 1 once died there of SIGABRT ("terminate called without an active
        # exception": a C++ thread still joinable as its destructor ran), after every step and the
        # barrier (docs/reliability.md, fault 30); nothing is left to write but the buffered output
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0
