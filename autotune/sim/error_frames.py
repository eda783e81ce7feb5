"""The pieces every simulated error text is built from: frames, tracebacks, sizes, timestamps.

Why imitate so closely: autotune's outcome classifier and monitor read real TRL / DeepSpeed / vLLM /
PyTorch output, so a rehearsal exercises them only if the tracebacks and messages carry the same
wording and numbers (sizes in PyTorch's binary units, vLLM's and DeepSpeed's timestamp formats).
"""

from __future__ import annotations

from datetime import datetime

from autotune.units import GIB

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


def model_type(model_cfg: dict) -> str:
    """transformers' module name for the model, for the traceback frames."""
    return str(model_cfg.get("model_type") or "llama").replace("-", "_")


def frame(path: str, line: int, func: str, code: str) -> str:
    return f'  File "{path}", line {line}, in {func}\n    {code}\n'


def traceback(frames: list[str], last: str) -> str:
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
