"""Published GRPO memory datapoints, run through autotune's memory model -> docs/memory-model.md.

Each datapoint is a configuration as its source reported it, with the source's peak memory per GPU
(GiB) or its verdict ("oom" / "fit"). The script predicts each one with
``autotune.candidate.memory.estimate`` (the same call ``autotune estimate`` makes) and writes the
comparison. It holds no predictions itself: rerun it after any change to the memory model.

    .venv/bin/python scripts/memory_datapoints.py            # writes docs/memory-model.md
    .venv/bin/python scripts/memory_datapoints.py --out X.md

Conventions:
- ``gpus`` is the number of GPUs that train (the data-parallel group the model states are sharded
  over). GPUs that only run a vLLM server or a reference model are not counted there; ``vllm_mode``
  "server" marks generation on other GPUs.
- ``prompt`` is TRL's max_prompt_length, ms-swift's ``--max_length``, verl's max_prompt_length.
- ``assumed`` lists every value the source did not state and that was filled with the framework's
  default of the time; a row with an unknown value that decides the verdict is not a row, it is in
  SKIPPED.
- ms-swift's ``--beta`` defaults to 0.04 (a reference model for full fine-tunes); TRL's defaulted
  to 0.04 until 0.18 and is 0.0 since.
- A quantized checkpoint carries its ``quantization_config`` (as config.json ships it) on top of
  its base model's card; ``quantization`` is ``--quantization`` (bitsandbytes in-flight).
  Vision-language rows give ``image_tokens`` per image and ``images_per_prompt``; ``prompt`` is then
  the text part only (ms-swift's ``--max_length`` counts both, so the text part is what is left).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autotune.candidate.memory import estimate  # noqa: E402
from autotune.hardware import find_gpu_type  # noqa: E402
from autotune.models import ModelSpec, load_card  # noqa: E402

DOC = ROOT / "docs" / "memory-model.md"
MIB = 1 / 1024  # GiB per MiB

SWIFT = "https://github.com/modelscope/ms-swift"
TRL = "https://github.com/huggingface/trl"
VERL_TUNING = "https://github.com/volcengine/verl/blob/main"
VALIDATION = "docs/gpu-validation.md (this repo)"

# Shared by the H100 validation runs (docs/gpu-validation.md): one H100 80GB, Qwen2.5-1.5B shapes,
# TRL 1.16 with transformers' generate (no vLLM), beta 0 (TRL 1.x default), peak read by NVML.
_GV = dict(
    model="Qwen2.5-1.5B",
    gpus=1,
    gpu="H100-80GB",
    capacity_gib=79.18,
    prompt=512,
    completion=256,
    num_generations=4,
    vllm=False,
    beta=0.0,
    lora_rank=None,
    framework="TRL 1.16",
    measured="NVML peak",
    source=VALIDATION,
    assumed=[],
)

# The second H100 lease (docs/gpu-validation.md, "Second lease"): scripts/gpu_checks.sh, TRL 1.16 on
# transformers 5.17 with its generate, torch 2.11, beta 0; no DeepSpeed unless the row says so.
_GC = {
    **_GV,
    "capacity_gib": 79.65,
    "grad_accum": 1,
    "zero_stage": 0,
    "offload": "none",
    "grad_ckpt": False,
    "measured": "trainer peak (max of torch reserved and device used)",
}
#: The ZeRO-3 offload row of the second lease, run again under the tensor probe in the fifth.
_GC_ZERO3_7B = {
    **_GC,
    "model": "Qwen2.5-7B",
    "prompt": 128,
    "completion": 64,
    "per_device_batch": 8,
    "zero_stage": 3,
    "offload": "optimizer+params",
    "grad_ckpt": True,
    "lora_rank": 16,
}
#: The QLoRA configuration both leases ran (the second cut after one step, the third whole).
_GC_QLORA = {
    **_GC,
    "prompt": 128,
    "completion": 128,
    "per_device_batch": 16,
    "grad_ckpt": True,
    "lora_rank": 16,
    "quantization": "4bit",
}

DATAPOINTS: list[dict[str, Any]] = [
    # --- docs/gpu-validation.md: autotune's own H100 runs --------------------------------------
    {
        **_GV,
        "id": "gv-A",
        "what": "trial A",
        "completion": 1024,
        "per_device_batch": 32,
        "grad_accum": 16,
        "zero_stage": 2,
        "offload": "optimizer",
        "grad_ckpt": True,
        "reported": 47.8,
    },
    {
        **_GV,
        "id": "gv-B0",
        "what": "trial B0",
        "per_device_batch": 16,
        "grad_accum": 1,
        "zero_stage": 0,
        "offload": "none",
        "grad_ckpt": False,
        "reported": 49.5,
    },
    {
        **_GV,
        "id": "gv-B1",
        "what": "trial B1",
        "per_device_batch": 16,
        "grad_accum": 1,
        "zero_stage": 1,
        "offload": "none",
        "grad_ckpt": False,
        "reported": 66.1,
    },
    {
        **_GV,
        "id": "gv-B2",
        "what": "trial B2 (V1, its verify run, measured the same)",
        "per_device_batch": 16,
        "grad_accum": 1,
        "zero_stage": 2,
        "offload": "none",
        "grad_ckpt": False,
        "reported": 66.1,
    },
    {
        **_GV,
        "id": "gv-V2",
        "what": "verify V2: torch.OutOfMemoryError at 79.6 GiB",
        "per_device_batch": 32,
        "grad_accum": 1,
        "zero_stage": 0,
        "offload": "none",
        "grad_ckpt": False,
        "reported": "oom",
    },
    {
        **_GV,
        "id": "gv-V3",
        "what": "verify V3",
        "per_device_batch": 16,
        "grad_accum": 1,
        "zero_stage": 3,
        "offload": "optimizer+params",
        "grad_ckpt": False,
        "reported": 42.0,
    },
    # --- docs/gpu-validation.md: the second H100 lease (scripts/gpu_checks.sh, 2026-11-26) --------
    # The trainer's peak: the larger of torch.cuda.max_memory_reserved and the device's used memory.
    *[
        {
            **_GC,
            "id": f"gc-run-{completion}-bs{batch}",
            "what": f"search trial, completions of {completion} tokens",
            "prompt": 128,
            "completion": completion,
            "per_device_batch": batch,
            "reported": peak,
        }
        for completion, batch, peak in [(128, 32, 35.3), (128, 16, 24.7), (64, 32, 29.2), (64, 16, 20.2)]
    ],
    {
        **_GC,
        "id": "gc-run-640-bs32",
        "what": "production run attempt, completions grown to 640 tokens: ran, at 79.5 of 79.6 GiB",
        "prompt": 128,
        "completion": 640,
        "per_device_batch": 32,
        "reported": "fit",
    },
    {
        **_GC_ZERO3_7B,
        "id": "gc-zero3-7b",
        "what": "Qwen2.5-7B under ZeRO-3, optimizer+params offload, LoRA r16 (generation peak 17.6 GiB)",
        "reported": 31.0,
    },
    {
        **_GC_QLORA,
        "id": "gc-qlora-1.5b",
        "what": "QLoRA (bitsandbytes NF4 on CUDA), LoRA r16: its first step's peak (then cut)",
        "reported": 3.1,
    },
    # --- docs/gpu-validation.md: the third H100 lease (scripts/gpu_checks.sh, 2026-11-27) ---------
    {
        **_GC,
        "id": "gc3-run-1024-bs32",
        "what": "production run attempt 2, completions grown to 1024 tokens: CUDA OOM at step 3",
        "prompt": 128,
        "completion": 1024,
        "per_device_batch": 32,
        "reported": "oom",
    },
    {
        **_GC,
        "id": "gc3-run-1024-bs16",
        "what": "production run attempt 3, the restart after that OOM: step 3 ran (checkpoint-3)",
        "prompt": 128,
        "completion": 1024,
        "per_device_batch": 16,
        "grad_accum": 2,
        "reported": 66.4,
    },
    {
        **_GC,
        "id": "gc3-vl-3b",
        "what": "vision-language search trial (synthetic images), five steps",
        "model": "Qwen2.5-VL-3B",
        "prompt": 128,
        "completion": 64,
        "per_device_batch": 8,
        "grad_ckpt": True,
        "image_tokens": 256,
        "images_per_prompt": 1,
        "reported": 32.8,
    },
    {
        **_GC_QLORA,
        "id": "gc3-qlora-1.5b",
        "what": "QLoRA (bitsandbytes NF4 on CUDA), LoRA r16: a whole search trial, four steps",
        "reported": 3.6,
    },
    # --- docs/gpu-validation.md: the fourth lease, on an H200 (scripts/gpu_checks.sh, 2026-11-28) ----
    *[
        {
            **_GC,
            "id": f"gc4-mb{batch}",
            "what": f"search trial on an H200, one global batch of 32 as {batch} x {32 // batch}",
            "gpu": "H200",
            "capacity_gib": 140.4,
            "prompt": 128,
            "completion": 128,
            "per_device_batch": batch,
            "grad_accum": 32 // batch,
            "reported": peak,
        }
        for batch, peak in [(2, 16.1), (8, 21.7), (32, 35.4)]
    ],
    # --- docs/gpu-validation.md: the fifth lease, on an H200 (the zero3probe part, 2026-11-28) -------
    {
        **_GC_ZERO3_7B,
        "id": "gc5-zero3-7b",
        "what": (
            "gc-zero3-7b again on an H200 under the tensor probe: 29.2 GiB reserved (14.7 for the "
            "default stream, 14.4 for DeepSpeed's all-gather stream), at most 14.6 allocated at once"
        ),
        "gpu": "H200",
        "capacity_gib": 140.4,
        "reported": 31.1,
    },
    # --- TRL issues ---------------------------------------------------------------------------
    {
        "id": "trl-3456a",
        "source": f"{TRL}/issues/3456",
        "what": "nvidia-smi while training",
        "model": "Qwen3-0.6B",
        "gpus": 1,
        "gpu": "A100-80GB",
        "capacity_gib": 80.0,
        "prompt": 2048,
        "completion": 1024,
        "per_device_batch": 4,
        "grad_accum": 1,
        "num_generations": 4,
        "zero_stage": 0,
        "offload": "none",
        "grad_ckpt": False,
        "vllm": False,
        "beta": 0.04,
        "lora_rank": None,
        "framework": "TRL 0.17-0.18",
        "measured": "nvidia-smi 49273MiB / 81920MiB",
        "reported": 49273 * MIB,
        "assumed": [
            "1 GPU, no DeepSpeed",
            "grad_accum 1",
            "num_generations 4 (only 'batch-size = 4' given)",
            "gradient checkpointing off (HF default then)",
            "beta 0.04 (TRL default then)",
            "no vLLM",
        ],
    },
    {
        "id": "trl-3456b",
        "source": f"{TRL}/issues/3456",
        "what": "nvidia-smi while training",
        "model": "Qwen3-1.7B",
        "gpus": 1,
        "gpu": "A100-80GB",
        "capacity_gib": 80.0,
        "prompt": 2048,
        "completion": 1024,
        "per_device_batch": 4,
        "grad_accum": 1,
        "num_generations": 4,
        "zero_stage": 0,
        "offload": "none",
        "grad_ckpt": False,
        "vllm": False,
        "beta": 0.04,
        "lora_rank": None,
        "framework": "TRL 0.17-0.18",
        "measured": "nvidia-smi 78147MiB / 81920MiB",
        "reported": 78147 * MIB,
        "assumed": [
            "1 GPU, no DeepSpeed",
            "grad_accum 1",
            "num_generations 4 (only 'batch-size = 4' given)",
            "gradient checkpointing off (HF default then)",
            "beta 0.04 (TRL default then)",
            "no vLLM",
        ],
    },
    # --- ms-swift examples (comments in the shipped scripts) -----------------------------------
    {
        "id": "swift-ex-transformers",
        "what": "example script, header '# GPU memory: 80GiB'",
        "source": f"{SWIFT} examples/train/grpo/internal/transformers.sh",
        "model": "Qwen2.5-7B",
        "gpus": 1,
        "gpu": "A100-80GB",
        "capacity_gib": None,
        "prompt": 2048,
        "completion": 1024,
        "per_device_batch": 4,
        "grad_accum": 1,
        "num_generations": 4,
        "zero_stage": 0,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": False,
        "beta": 0.04,
        "lora_rank": 8,
        "framework": "ms-swift",
        "measured": "stated GPU memory",
        "reported": "fit",
        "assumed": [
            "an 80 GiB GPU (the header's figure)",
            "gradient checkpointing on (swift default)",
            "beta 0.04 (swift default)",
        ],
    },
    {
        "id": "swift-ex-grpo_zero2",
        "what": "example script, header '# GPU memory: 8 * 80GiB'",
        "source": f"{SWIFT} examples/train/grpo/grpo_zero2.sh @ 207e6da65",
        "model": "Qwen2.5-7B-Instruct",
        "gpus": 7,
        "gpu": "A100-80GB",
        "capacity_gib": None,
        "prompt": 4096,
        "completion": 2048,
        "per_device_batch": 1,
        "grad_accum": 2,
        "num_generations": 7,
        "zero_stage": 2,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": True,
        "vllm_mode": "server",
        "vllm_frac": 0.7,
        "beta": 0.04,
        "lora_rank": None,
        "framework": "ms-swift 3.x (trl 0.15)",
        "measured": "stated GPU memory",
        "reported": "fit",
        "assumed": [
            "80 GiB GPUs (the header's figure)",
            "gradient checkpointing on (swift default)",
            "beta 0.04 (swift default)",
        ],
    },
    {
        "id": "swift-ex-lora_vllm",
        "what": "example script, header '# GPU memory: 2 * 80GiB'",
        "source": f"{SWIFT} examples/train/grpo/lora_vllm.sh @ 3a41ccaff",
        "model": "Qwen2.5-7B",
        "gpus": 1,
        "gpu": "A100-80GB",
        "capacity_gib": None,
        "prompt": 2048,
        "completion": 1024,
        "per_device_batch": 16,
        "grad_accum": 1,
        "num_generations": 16,
        "zero_stage": 2,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": True,
        "vllm_mode": "server",
        "vllm_frac": 0.7,
        "beta": 0.04,
        "lora_rank": 8,
        "framework": "ms-swift 3.x (trl 0.15)",
        "measured": "stated GPU memory",
        "reported": "fit",
        "assumed": [
            "80 GiB GPUs (the header's figure)",
            "1 training GPU + 1 vLLM GPU (vllm_device auto, no NPROC_PER_NODE)",
            "gradient checkpointing on (swift default)",
            "beta 0.04 (swift default)",
        ],
    },
    {
        "id": "swift-doc-qwen3-8b",
        "what": "Qwen3 best-practice doc, GRPO script header '# 70G*8'",
        "source": f"{SWIFT} docs/source_en/BestPractices/Qwen3-Best-Practice.md",
        "model": "Qwen3-8B",
        "gpus": 8,
        "gpu": "A100-80GB",
        "capacity_gib": None,
        "prompt": 4096,
        "completion": 4096,
        "per_device_batch": 2,
        "grad_accum": 1,
        "num_generations": 16,
        "zero_stage": 3,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": True,
        "vllm_mode": "colocate",
        "vllm_frac": 0.4,
        "vllm_sleep": True,
        "beta": 0.04,
        "lora_rank": None,
        "framework": "ms-swift 3.x",
        "measured": "'70G' per GPU stated in the doc",
        "reported": 70.0,
        "assumed": [
            "GPU type not stated: an 80 GB class GPU (only the verdict uses it)",
            "'70G' read as GiB",
            "--offload_model/--offload_optimizer move states to the CPU "
            "only while vLLM generates: not DeepSpeed offload",
            "gradient checkpointing on (swift default)",
            "beta 0.04 (swift default)",
        ],
    },
    # --- ms-swift issues -----------------------------------------------------------------------
    {
        "id": "swift-4486",
        "what": "OOM right at the start (8 x H20 96G: 6 train, 2 for `swift rollout`)",
        "source": f"{SWIFT}/issues/4486",
        "model": "Qwen2.5-3B-Instruct",
        "gpus": 6,
        "gpu": "H20",
        "capacity_gib": None,
        "prompt": 2048,
        "completion": 2048,
        "per_device_batch": 2,
        "grad_accum": 8,
        "num_generations": 4,
        "zero_stage": 3,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": True,
        "vllm_mode": "server",
        "beta": 0.04,
        "lora_rank": None,
        "framework": "ms-swift 3.x",
        "measured": "OOM",
        "reported": "oom",
        "assumed": ["gradient checkpointing on (swift default)", "beta 0.04 (swift default)"],
    },
    {
        "id": "swift-4311",
        "what": "OOM (the source of seed 003), 4 x 90G",
        "source": f"{SWIFT}/issues/4311",
        "model": "Qwen2.5-VL-3B-Instruct",
        "gpus": 4,
        "gpu": "90G (as reported)",
        "capacity_gib": 90.0,
        "prompt": 2048 - 768,
        "image_tokens": 768,
        "images_per_prompt": 1,
        "completion": 1024,
        "per_device_batch": 8,
        "grad_accum": 4,
        "num_generations": 8,
        "zero_stage": 3,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": False,
        "beta": 0.04,
        "lora_rank": None,
        "framework": "ms-swift 3.x",
        "measured": "OOM",
        "reported": "oom",
        "assumed": [
            "gradient checkpointing on (swift default)",
            "beta 0.04 (swift default)",
            "no vLLM (--use_vllm not given)",
            "one image per prompt at the MAX_PIXELS=602112 cap: "
            "602112 / 28^2 = 768 image tokens, inside --max_length 2048 (1280 text tokens left)",
            "--freeze_vit False: the vision tower trains (full fine-tune)",
        ],
    },
    # --- verl: docs/perf/device_tuning.rst, "MIN" rows (fits, FSDP ~ ZeRO-3) --------------------
    *[
        {
            "id": f"verl-min-{size}",
            "what": "device_tuning.rst MIN row (ran; FSDP mapped to ZeRO-3)",
            "source": f"{VERL_TUNING}/examples/tuning/{size}/qwen2-{size}_grpo-lora_1_h100_fsdp_vllm.sh",
            "model": model,
            "gpus": 1,
            "gpu": "H100-80GB",
            "capacity_gib": None,
            "prompt": 512,
            "completion": 1024,
            "per_device_batch": micro,
            "grad_accum": 1,
            "num_generations": 5,
            "zero_stage": 3,
            "offload": "optimizer+params",
            "grad_ckpt": True,
            "vllm": True,
            "vllm_mode": "colocate",
            "vllm_frac": frac,
            "vllm_sleep": True,
            "beta": 0.001,
            "lora_rank": 32,
            "framework": "verl (vllm 0.8.3)",
            "measured": "ran",
            "reported": "fit",
            "assumed": [
                "ppo_micro_batch_size read as sequences per micro-batch",
                "vLLM frees its cache while training (verl free_cache_engine default)",
                "padding removed by verl: real peak is lower than at full length",
            ],
        }
        for size, model, micro, frac in [
            ("0.5b", "Qwen2.5-0.5B-Instruct", 116, 0.1),
            ("1.5b", "Qwen2.5-1.5B-Instruct", 128, 0.1),
            ("3b", "Qwen2.5-3B-Instruct", 62, 0.1),
            ("7b", "Qwen2.5-7B-Instruct", 16, 0.2),
        ]
    ],
    # --- shared/seeds/001: QLoRA on a GPTQ-int4 base ---------------------------------------------
    {
        "id": "seed-001",
        "what": "the configuration that trained after the OOM fixes",
        "source": "shared/seeds/001 (TRL GRPO write-up, QLoRA + vLLM on a GPTQ-int4 Qwen2.5-7B)",
        "model": "Qwen2.5-7B-Instruct",
        "quantization_config": {
            "bits": 4,
            "group_size": 128,
            "damp_percent": 0.01,
            "desc_act": False,
            "quant_method": "gptq",
            "static_groups": False,
            "sym": True,
            "true_sequential": True,
        },
        "gpus": 2,
        "gpu": "A100-40GB",
        "capacity_gib": None,
        "prompt": 500,
        "completion": 2000,
        "per_device_batch": 2,
        "grad_accum": 1,
        "num_generations": 2,
        "zero_stage": 0,
        "offload": "none",
        "grad_ckpt": True,
        "vllm": True,
        "vllm_mode": "colocate",
        "vllm_frac": 0.2,
        "beta": 0.0,
        "lora_rank": 16,
        "framework": "TRL (2025)",
        "measured": "trained (vLLM at 7.88 GB of its 0.2 share)",
        "reported": "fit",
        "assumed": [
            "max_model_len 2500 split as 500 prompt + 2000 completion (the split is not stated; any split "
            "fits)",
            "LoRA rank 16 (not stated; adapters are 0.3 GiB at r16)",
            "quantization_config of Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 (bits 4, group 128)",
            "gradient checkpointing on, no DeepSpeed, beta 0 (TRL 1.x default)",
            "vLLM loads the GPTQ weights (TRL's path; the write-up's unsloth trick shared them instead)",
        ],
    },
    # --- OpenRLHF issues -----------------------------------------------------------------------
    {
        "id": "openrlhf-901",
        "what": "OOM, actor on 2 x RTX 6000 Ada 48G (ref on 2 others)",
        "source": "https://github.com/OpenRLHF/OpenRLHF/issues/901",
        "model": "Qwen2.5-7B-Instruct",
        "gpus": 2,
        "gpu": "48G (as reported)",
        "capacity_gib": 48.0,
        "prompt": 1024,
        "completion": 1,
        "per_device_batch": 2,
        "grad_accum": 1,
        "num_generations": 8,
        "zero_stage": 2,
        "offload": "none",
        "grad_ckpt": False,
        "vllm": False,
        "beta": 0.0,
        "lora_rank": None,
        "framework": "OpenRLHF",
        "measured": "OOM",
        "reported": "oom",
        "assumed": [
            "gradient checkpointing off (OpenRLHF default; not in the command)",
            "vLLM engines not shown: counted as not on the actor GPUs",
            "reference model on its own GPUs (ref_num_gpus_per_node 2)",
        ],
    },
]

# Found, read, and left out: why each could not be predicted from what its source states.
SKIPPED: list[dict[str, str]] = [
    {
        "source": "shared/seeds/000 (ms-swift 3.1.1, Qwen2.5-7B-Instruct, 4 x A100-80GB)",
        "reason": "no max_completion_length and no tuner type (full or LoRA both read from the text); "
        "original issue not found",
    },
    {
        "source": "shared/seeds/001's OOM config (TRL, Qwen2.5-7B-GPTQ-int4 QLoRA, 2 x A100-40GB)",
        "reason": "the batch, generations and lengths of the run that ran out of memory "
        "(38.05 GB allocated by PyTorch) are not stated; its fixed config is row seed-001",
    },
    {
        "source": "shared/seeds/002 (Open-Reasoner-Zero PPO, Qwen2.5-1.5B)",
        "reason": "PPO with critic and reward models, not GRPO; vLLM fraction of the OOM run not stated",
    },
    {
        "source": "shared/seeds/003 fix config (Qwen2.5-VL-3B, vLLM TP4 0.5, sleep 1)",
        "reason": "the fitting config's lengths are not in the write-up (its OOM config is row swift-4311)",
    },
    {
        "source": "shared/seeds/004 (Qwen2.5-VL-3B LoRA, zero3_offload)",
        "reason": "no memory figure and no lengths: it is about GPU utilisation",
    },
    {
        "source": f"{TRL}/issues/3678 (Qwen3-0.6B, 20G GPU, 256+256, OOM)",
        "reason": "batch size and num_generations not in the report",
    },
    {
        "source": f"{TRL}/issues/2972 (Qwen 7B, 4 x H20, OOM at step 2)",
        "reason": "model variant and DeepSpeed setup not stated (TRL 0.15 vLLM-on-its-own-GPU era)",
    },
    {
        "source": f"{SWIFT}/issues/4594 (Qwen3-1.7B LoRA, 8 x A100, vLLM colocate OOM)",
        "reason": "A100 memory size (40 or 80 GB) not stated",
    },
    {
        "source": f"{SWIFT}/issues/3848 (Qwen2.5-3B LoRA, maintainer measured ~12GB fwd/bwd peak)",
        "reason": "the command as stored is cut before its DeepSpeed flags",
    },
    {
        "source": f"{SWIFT}/issues/3426 (Qwen2.5-VL-7B LoRA, ~70G per card on 2 x A800)",
        "reason": "no --max_length and no image size: the prompt length decides the figure",
    },
    {
        "source": f"{SWIFT}/issues/3871 (QwQ-32B fine-tune, 8 x 96G, OOM)",
        "reason": "the command as stored is cut before its tensor-parallel / DeepSpeed flags",
    },
    {
        "source": f"{SWIFT} examples/train/grpo/full_vllm_qwenvl.sh @ a441ac7d0 ('8 * 60GiB')",
        "reason": "Qwen2.5-VL-3B with async generation and no --max_length stated",
    },
    {
        "source": f"{VERL_TUNING}/examples/tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh (MIN row)",
        "reason": "Qwen2-7B has no card (architecture not read from a source here)",
    },
    {
        "source": "https://github.com/OpenRLHF/OpenRLHF/issues/887 (7B, 32k response, OOM)",
        "reason": "model not named",
    },
]


def _capacity(dp: dict[str, Any]) -> float:
    if dp.get("capacity_gib"):
        return float(dp["capacity_gib"])
    return find_gpu_type(dp["gpu"]).memory_gib


def _params(dp: dict[str, Any]) -> dict[str, Any]:
    vllm = bool(dp.get("vllm"))
    params = {
        "per_device_train_batch_size": dp["per_device_batch"],
        "gradient_accumulation_steps": dp["grad_accum"],
        "num_generations": dp["num_generations"],
        "zero_stage": dp["zero_stage"],
        "offload": dp["offload"],
        "gradient_checkpointing": dp["grad_ckpt"],
        "use_vllm": vllm,
    }
    if vllm:
        params["vllm_mode"] = dp.get("vllm_mode", "colocate")
        params["vllm_gpu_memory_utilization"] = dp.get("vllm_frac", 0.9)
        params["vllm_tensor_parallel_size"] = dp.get("vllm_tp", 1)
        params["vllm_enable_sleep_mode"] = bool(dp.get("vllm_sleep", False))
    return params


def predict(dp: dict[str, Any]) -> Any:
    """The memory model's Estimate for one datapoint, or None when autotune has no card for it."""
    model = load_card(dp["model"])
    if model is None:
        return None
    if dp.get("quantization_config"):  # a quantized checkpoint of the card's architecture
        model = ModelSpec(
            name=dp["model"],
            config={**model.config, "quantization_config": dp["quantization_config"]},
            source="path",
            path=None,
            has_weights=False,
        )
    kwargs: dict[str, Any] = dict(
        gpus=dp["gpus"],
        capacity_gib=_capacity(dp),
        max_prompt_length=dp["prompt"],
        max_completion_length=dp["completion"],
        beta=dp.get("beta", 0.0),
        lora_rank=dp.get("lora_rank"),
        dp_gpus=dp["gpus"],
        quantization=dp.get("quantization"),
        image_tokens=dp.get("image_tokens", 0),
        images_per_prompt=dp.get("images_per_prompt", 1),
    )
    accepted = inspect.signature(estimate).parameters
    return estimate(model, _params(dp), **{k: v for k, v in kwargs.items() if k in accepted})


def evaluate() -> dict[str, Any]:
    """Predict every datapoint; the rows and the headline numbers of the doc."""
    rows, no_card = [], []
    for dp in DATAPOINTS:
        est = predict(dp)
        if est is None:
            no_card.append(dp)
            continue
        rep = dp["reported"]
        row = {"dp": dp, "est": est, "capacity": _capacity(dp)}
        if isinstance(rep, (int, float)):
            row["error"] = (est.total_gib - rep) / rep
            rep_fits = rep <= row["capacity"]
        else:
            rep_fits = rep == "fit"
        row["reported_fits"] = rep_fits
        row["agrees"] = est.fits == rep_fits
        rows.append(row)
    errors = [abs(r["error"]) for r in rows if "error" in r]
    verdict_rows = [r for r in rows if "error" not in r]
    return {
        "rows": rows,
        "no_card": no_card,
        "n_peaks": len(errors),
        "median_abs_error": statistics.median(errors) if errors else None,
        "mean_abs_error": statistics.fmean(errors) if errors else None,
        "n_verdicts": len(verdict_rows),
        "verdicts_agree": sum(r["agrees"] for r in verdict_rows),
        "n_all": len(rows),
        "all_agree": sum(r["agrees"] for r in rows),
    }


def _config(dp: dict[str, Any]) -> str:
    bits = [
        f"{dp['gpus']}x {dp['gpu']}",
        f"{dp['prompt']}+{dp['completion']}",
        f"bs={dp['per_device_batch']} ga={dp['grad_accum']} G={dp['num_generations']}",
        f"zero={dp['zero_stage']}" + (f" off={dp['offload']}" if dp["offload"] != "none" else ""),
        "gc" if dp["grad_ckpt"] else "no-gc",
    ]
    if dp.get("image_tokens"):
        bits.append(f"{dp.get('images_per_prompt', 1)} x {dp['image_tokens']} image tokens")
    if dp.get("lora_rank"):
        bits.append(f"LoRA r{dp['lora_rank']}")
    if dp.get("quantization_config"):
        qc = dp["quantization_config"]
        bits.append(f"{qc['quant_method'].upper()} int{qc['bits']}")
    if dp.get("quantization"):
        bits.append(f"bnb {dp['quantization']}")
    if dp.get("vllm"):
        mode = dp.get("vllm_mode", "colocate")
        v = f"vLLM {mode}"
        if mode == "colocate":
            v += f" {dp.get('vllm_frac', 0.9)}" + (" sleep" if dp.get("vllm_sleep") else "")
        bits.append(v)
    else:
        bits.append("no vLLM")
    if dp.get("beta"):
        bits.append(f"beta={dp['beta']}")
    return ", ".join(bits)


def _reported(dp: dict[str, Any]) -> str:
    rep = dp["reported"]
    return f"{rep:.1f} GiB" if isinstance(rep, (int, float)) else rep.upper() if rep == "oom" else rep


def _dominant(est: Any) -> str:
    parts = sorted(est.parts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts[:3] if v > 0.05)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    out: list[str] = []
    w = out.append
    w("# The memory model against published GRPO memory figures")
    w("")
    w(
        "Generated by `scripts/memory_datapoints.py` from the datapoints it holds; do not edit by hand "
        "(`tests/test_memory_datapoints.py` fails when this file is not what the current "
        "`autotune/candidate/memory.py` gives). Each row is a configuration as its source reported it, "
        "the peak memory per GPU or the OOM/fit verdict the source reported, and what "
        "`autotune.candidate.memory.estimate` predicts for it (uncalibrated: no measured history)."
    )
    w("")
    w("## Headline")
    w("")
    w(
        f"- Peak datapoints: {result['n_peaks']}; median absolute relative error "
        f"**{_pct(result['median_abs_error'])}**, mean {_pct(result['mean_abs_error'])}."
    )
    w(
        f"- OOM/fit datapoints: {result['n_verdicts']}; the model's verdict agrees on "
        f"**{result['verdicts_agree']} of {result['n_verdicts']}**."
    )
    w(
        f'- Over all {result["n_all"]} rows (a reported peak below capacity counts as "fit", the '
        f'OOM run as "oom"): {result["all_agree"]} of {result["n_all"]} verdicts agree.'
    )
    n_skip = len(SKIPPED) + len(result["no_card"])
    w(
        f"- Left out: {n_skip} reports ({len(SKIPPED)} with too little configuration to predict, "
        f"{len(result['no_card'])} for a model autotune has no card for); listed at the end."
    )
    w("")
    w(
        "Sources: autotune's own H100 runs (docs/gpu-validation.md), TRL, ms-swift, verl and "
        "OpenRLHF issues, scripts and docs, and the write-ups in shared/seeds/. Config column: "
        "training GPUs x type, prompt+completion tokens, per-device batch (completions), gradient "
        "accumulation, num_generations, ZeRO stage and offload, gradient checkpointing, LoRA rank, "
        "vLLM mode and memory fraction, beta (a reference model when > 0)."
    )
    w("")
    w(
        "| id | model | config | reported | predicted GiB (capacity) | error / verdict | "
        "largest parts (GiB) | source |"
    )
    w("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dp, est = r["dp"], r["est"]
        if "error" in r:
            judge = f"{r['error']:+.0%}"
        else:
            judge = (
                "agrees" if r["agrees"] else "**disagrees**"
            ) + f" (model: {'fit' if est.fits else 'oom'})"
        if est.vllm_problem:
            judge += f", vLLM: {est.vllm_problem}"
        w(
            f"| {dp['id']} | {dp['model']} | {_config(dp)} | {_reported(dp)} | "
            f"{est.total_gib:.1f} ({r['capacity']:.1f}) | {judge} | {_dominant(est)} | "
            f"{dp['source']} |"
        )
    w("")
    w("What each source states, and what was filled in with the framework's default:")
    w("")
    for r in rows:
        dp = r["dp"]
        assumed = "; ".join(dp["assumed"]) if dp["assumed"] else "nothing"
        w(f"- **{dp['id']}** ({dp['framework']}; {dp['measured']}; {dp['what']}). Assumed: {assumed}.")
    w("")
    w("## Where the model and the reports disagree")
    w("")
    big = [r for r in rows if ("error" in r and abs(r["error"]) > 0.15) or not r["agrees"]]
    if not big:
        w("No row is off by more than 15% or has a verdict the model does not share.")
    for r in big:
        dp, est = r["dp"], r["est"]
        what = (
            f"predicted {est.total_gib:.1f} GiB against {_reported(dp)} ({r['error']:+.0%})"
            if "error" in r
            else f"reported {_reported(dp)}, the model says {'fit' if est.fits else 'oom'} "
            f"({est.total_gib:.1f} of {r['capacity']:.1f} GiB)"
        )
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in est.parts.items())
        w(f"- **{dp['id']}**: {what}. Parts: {parts}.")
    w("")
    w("Which parts of the model these rows leave uncertain:")
    w("")
    w(
        "- **Model states.** DeepSpeed's bf16 engine keeps fp32 master weights and fp32 gradient "
        "partitions next to the bf16 model; on one GPU nothing shards them away. The ZeRO-3 7B rows "
        "(gc-zero3-7b, gc5-zero3-7b) are 44% low against the peak autotune judges trials by, which "
        "counts the allocator's caches: under ZeRO-3 with transformers' generate it keeps one pool of "
        "gathered weights for TRL's stream and one for DeepSpeed's (measured by stream in the fifth "
        "lease), while at most 14.6 GiB was allocated at once; against that plus the memory outside "
        "torch (16.0 GiB) the model's 17.2 is 8% high. Only the H100 rows "
        "(gv-B0..gv-V3: one batch measured under ZeRO 0, 1, 2 and 3) isolate the stage, and "
        "docs/gpu-validation.md names them as calibration data for the memory model, so a small "
        "error there may be in-sample rather than evidence that the model generalises."
    )
    w(
        "- **Logits.** With Qwen's 152k vocabulary the logits term (micro-batch x completion x vocab, "
        "times a peak factor) is the largest part of every long-completion row. Its factor comes from "
        "TRL reports (trl 3678, open-r1 615). The verl MIN rows train on GSM8K, whose responses are "
        "far shorter than max_response_length 1024, with padding removed: their logits are real "
        "tokens x vocab, so a worst-case model at full length must call their huge micro-batches "
        "OOM. Those rows test the model's assumption that every completion reaches its maximum "
        "(the right one for a tuning search, see reference.md), not the factor."
    )
    w(
        "- **Activations.** Korthikanti's per-layer formula assumes every sequence at full "
        "prompt+completion length. verl removes padding and most reports run real data shorter than "
        "the maximum, so for fits the model is conservative by construction."
    )
    w(
        "- **vLLM share.** Colocated vLLM is modelled as its fraction of total memory, or a fixed "
        "leftover under sleep mode. No row here measures vLLM memory directly (the H100 runs had no "
        "vLLM); the fit verdicts of the verl rows and the ms-swift examples check it only as a bound."
    )
    w(
        "- **Overhead.** CUDA context, NCCL buffers and allocator slack are a constant; nvidia-smi "
        "readings (trl-3456) include them, torch-allocator readings (ms-swift's `memory(GiB)`) do "
        "not, and NVML sees the allocator's cached but free blocks too."
    )
    w(
        "- **Vision tower (swift-4311).** Its parameters are counted exactly (tests/test_models.py) and "
        "its activations per patch were counted on transformers' own Qwen2.5-VL block (31 x hidden + 8 x "
        "intermediate bytes, tests/test_vl.py), but attention is counted as FlashAttention would keep it: "
        "under eager or math-SDPA attention the tower's four full-attention blocks also keep heads x "
        "patches^2 per image (16 x 3072^2 x 2 bytes = 0.28 GiB per 768-token image per block). The "
        "logits are counted over the completion only; a trainer that materialises them over the whole "
        "2048 + 1024-token sequence triples that part (10.7 -> 32 GiB here, derived). The images per "
        "prompt and their size are assumed (MAX_PIXELS caps them). Which of these made swift-4311 "
        "run out of 90 GB is not known; the model calls it a fit at 39 GiB."
    )
    w(
        "- **Quantized bases (seed-001).** The weight bytes are what bitsandbytes really allocates for "
        "NF4 and int8 (tests/test_quantization.py) and the GPTQ/AWQ storage arithmetic (4-bit codes, an "
        "fp16 scale and a packed zero per 128 inputs, GPTQ's g_idx); the dequantization workspace "
        "(twice the largest matrix in bf16) and vLLM's copy of a quantized base (GPTQ as stored, "
        "bitsandbytes 4-bit in-flight) are not measured. The seed's fitting config is a verdict only: "
        "its OOM run's config is not stated."
    )
    w(
        "- **Reported verdicts.** An OOM report is a single run: a bug or a long outlier sample can "
        "cause it (swift-4486 was run with a server-mode rollout and a small batch), and an example "
        'script\'s "GPU memory" header may state the GPU rather than the peak. These rows are '
        "weaker evidence than a measured peak."
    )
    w("")
    w("## Left out")
    w("")
    for dp in result["no_card"]:
        w(
            f"- {dp['source']} ({dp['id']}): no autotune card for {dp['model']}; it becomes a row "
            f"as soon as one exists."
        )
    for s in SKIPPED:
        w(f"- {s['source']}: {s['reason']}.")
    w("")
    return "\n".join(out)


def write(path: Path = DOC) -> dict[str, Any]:
    result = evaluate()
    path.write_text(render(result))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DOC)
    args = ap.parse_args(argv)
    result = write(args.out)
    print(
        f"wrote {args.out}: {result['n_peaks']} peaks, median |error| "
        f"{_pct(result['median_abs_error'])}; verdicts {result['verdicts_agree']}/"
        f"{result['n_verdicts']} agree; {len(result['no_card']) + len(SKIPPED)} left out"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
