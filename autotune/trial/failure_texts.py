"""The failure texts a trial's log is read for: the real wordings of PyTorch, NCCL, vLLM, TRL and
ms-swift, each with the failure kind it means (docs/trial-contract.md, "How a trial ends").

Why a module of its own: the table grows with every library release, while the way a log is
read (:mod:`autotune.trial.classify`: the root cause before its consequences) does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Rule",
    "RULES",
    "SIGKILL",
    "SECONDARY_NAMES",
    "SECONDARY_TEXT",
    "FATAL",
    "CHAINED",
    "PIN_MEMORY",
    "ROOT_CAUSE_WORDS",
    "WORTH_READING",
    "TRANSIENT",
    "transient_error",
    "crash_signature",
]


@dataclass(frozen=True)
class Rule:
    category: str  # "oom" | "invalid"
    kind: str | None  # an OOM_KIND for "oom"
    regex: re.Pattern[str]
    exception_only: tuple[str, ...] = ()  # match only when the line's exception name is one of these
    rank: int = 5  # lower = better error line among lines of the same kind


def _r(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile(pattern, flags)


RULES: tuple[Rule, ...] = (
    # --- vLLM: its own words are more specific than any CUDA message, so they come first
    Rule(
        "oom",
        "vllm_startup",
        _r(r"Free memory on device.*on startup is less than desired GPU memory utilization"),
        rank=0,
    ),
    Rule("oom", "vllm_kv", _r(r"No available memory for the cache blocks"), rank=0),
    Rule(
        "oom",
        "vllm_kv",
        _r(r"KV cache is needed, which is larger than the available KV cache memory"),
        rank=0,
    ),
    Rule(
        "oom",
        "vllm_kv",
        _r(r"is larger than the maximum number of tokens that can be stored in KV cache"),
        rank=0,
    ),
    # --- host RAM
    Rule("oom", "host", _r(r"ray\.exceptions\.OutOfMemoryError"), rank=1),
    Rule("oom", "host", _r(r"DefaultCPUAllocator: can't allocate memory"), rank=0),
    Rule("oom", "host", _r(r"std::bad_alloc"), rank=2),
    Rule("oom", "host", _r(r"DataLoader worker \(pid.*\) is killed by signal: Killed"), rank=1),
    Rule("oom", "host", _r(r"\[Errno 12\] Cannot allocate memory"), rank=2),
    Rule("oom", "host", _r(r"MemoryError"), exception_only=("MemoryError", "builtins.MemoryError"), rank=1),
    # --- accelerator memory
    Rule("oom", "cuda", _r(r"CUDA out of memory\.\s*Tried to allocate"), rank=0),
    Rule("oom", "cuda", _r(r"(?<![\w.])(?:torch\.)?(?:cuda\.)?OutOfMemoryError\b"), rank=1),
    Rule(
        "oom",
        "cuda",
        _r(r"CUDA out of memory"),
        exception_only=(
            "RuntimeError",
            "OutOfMemoryError",
            "torch.OutOfMemoryError",
            "torch.cuda.OutOfMemoryError",
            "torch.AcceleratorError",
        ),
        rank=1,
    ),
    Rule("oom", "cuda", _r(r"CUDA error:\s*out of memory", re.IGNORECASE), rank=1),
    Rule("oom", "cuda", _r(r"\b(?:CUBLAS|CUDNN|CUSOLVER|CUSPARSE)_STATUS_ALLOC_FAILED\b"), rank=1),
    Rule("oom", "cuda", _r(r"Cuda failure\s+(?:\d+\s+)?'out of memory'", re.IGNORECASE), rank=2),
    Rule(
        "oom",
        "cuda",
        _r(r"\b(?:cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|hipErrorOutOfMemory)\b"),
        rank=2,
    ),
    Rule("oom", "cuda", _r(r"\b(?:HIP|XPU|NPU|GCU|MPS backend) out of memory\b"), rank=1),
    # --- configurations the trainer refuses (TRL GRPOConfig / vLLM colocate, ms-swift's copies)
    Rule(
        "invalid",
        None,
        _r(r"generation_batch_size \(\d+\) must (?:be (?:evenly )?divisible by|equal)"),
        rank=0,
    ),
    Rule("invalid", None, _r(r"GRPO requires at least 2 generations per prompt"), rank=0),
    Rule("invalid", None, _r(r"tensor_parallel_size \(\d+\) must divide world size"), rank=0),
    Rule("invalid", None, _r(r"global eval batch size .* must be (?:evenly )?divisible by"), rank=0),
    Rule(
        "invalid",
        None,
        _r(r"'generation_batch_size' and 'steps_per_generation' can not be both configured"),
        rank=0,
    ),
    Rule("invalid", None, _r(r"auto_find_batch_size is not supported by GRPO"), rank=0),
    Rule("invalid", None, _r(r"steps_per_generation must be > 0"), rank=0),
)

# The process died of SIGKILL: the OOM killer's signature when nothing else explains the exit.
SIGKILL = re.compile(
    r"Signal 9 \(SIGKILL\) received by PID"
    r"|exitcode\s*:\s*-9\b"
    r"|died with <Signals\.SIGKILL: 9>"
    r"|return code = -9\b"
    r"|^(?:\S+: )?line \d+:\s+\d+ Killed\b"
    r"|^Killed\s*$"
)

# Errors that are consequences of another process's failure, never a root cause.
SECONDARY_NAMES = {
    "ChildFailedError",
    "CalledProcessError",
    "SignalException",
    "ProcessExitedException",
    "DistNetworkError",
    "DistStoreError",
    "EngineDeadError",
    "EngineGenerateError",
    "BrokenPipeError",
    "ConnectionResetError",
    "ConnectionAbortedError",
}
SECONDARY_TEXT = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing"
    r"|Watchdog caught collective operation timeout|NCCL communicator was aborted"
    r"|Some NCCL operations have failed or timed out|Process group watchdog thread terminated"
    r"|Engine core initialization failed|EngineCore encountered a fatal error"
    r"|died unexpectedly|Broken pipe|recvValue failed|failed to recv|Socket Timeout"
    r"|terminate called after throwing an instance of 'c10::DistBackendError'"
    r"|To avoid data inconsistency, we are taking the entire process down"
    r"|received by PID|got signal: \d+",
    re.IGNORECASE,
)
# Fatal errors that print no Python exception.
FATAL = re.compile(
    r"Segmentation fault|Fatal Python error:|terminate called after throwing an instance of"
    r"|Aborted \(core dumped\)|Bus error|Illegal instruction|core dumped"
)
# Python's words between chained tracebacks: the exception below follows from the one above.
CHAINED = re.compile(
    r"^During handling of the above exception, another exception occurred:"
    r"|^The above exception was the direct cause of the following exception:"
)
PIN_MEMORY = re.compile(r"pin_memory|cudaHostAlloc|pinned", re.IGNORECASE)


# Words without which no rule above can match a line (a cheap filter before the rules, so that a
# 64 MiB log is read in about a second), and those of the memory and configuration rules alone.
ROOT_CAUSE_WORDS = re.compile(
    r"emory|alloc|ALLOC|MEMORY|KV cache|Killed|generation|tensor_parallel_size"
    r"|divisible|auto_find_batch_size"
)
WORTH_READING = re.compile(
    ROOT_CAUSE_WORDS.pattern + r"|Error|Exception|Exit|Interrupt|Failure|Exceeded"
    r"|fault|Fatal|terminate called|Abort|Bus error|Illegal|dumped|SIGKILL|exitcode"
    r"|return code|NCCL WARN"
)


# Crashes that say nothing about the configuration (autotune/search/transient.py re-runs them once):
# an NCCL watchdog timeout after a slow peer, a reset connection
TRANSIENT = re.compile(
    r"DistBackendError|Watchdog caught collective operation timeout|NCCL communicator was aborted"
    r"|Some NCCL operations have failed or timed out|Process group watchdog thread terminated"
    r"|ncclRemoteError|ncclSystemError|NCCL timeout|Connection reset by peer|Connection closed by peer"
    r"|DistNetworkError|DistStoreError|Socket Timeout|recvValue failed",
    re.IGNORECASE,
)


def transient_error(*texts: str | None) -> bool:
    """Whether an error line (or detail) is of a known transient class."""
    return any(t and TRANSIENT.search(t) for t in texts)


def crash_signature(error_line: str | None) -> str:
    """An error line with numbers and paths blurred, so 'the same crash' survives trial numbers,
    process ids and a Ray worker's ``(pid=..., ip=...)`` prefix."""
    text = re.sub(r"(/[^\s:'\"]+)+", "<path>", error_line or "")
    return re.sub(r"\d+(\.\d+)?", "#", text)
