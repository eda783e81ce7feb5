"""Measurement inside the trial process: the metrics lines of the trial contract.

:class:`TrialMetricsCallback` writes one metrics line (docs/trial-contract.md) per optimizer step to
``$AUTOTUNE_METRICS_FILE``; :class:`_GenerationTimer` times TRL's generation, which TRL does not
log; memory is reduced to its maximum over ranks (:func:`_max_over_ranks`), on CPU as the peak
RSS (:func:`_cpu_peak_rss_gib`).
"""

from __future__ import annotations

import functools
import json
import math
import resource
import time
from pathlib import Path
from typing import Any

from autotune.units import GIB

__all__ = ["TrialMetricsCallback", "make_metrics_callback"]


def _is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _max_over_ranks(values: list[float], device: Any) -> list[float]:
    """Element-wise maximum across processes (every rank must call this, in the same order)."""
    if not _is_distributed():
        return values
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


class _GenerationTimer:
    """Wall time spent in TRL's ``_generate`` (sampling completions), summed until read.

    TRL times generation only for wandb/mlflow/trackio (``profiling_context``), never in the log
    dicts, so the trainer's bound method is wrapped on the instance instead.
    """

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, trainer: Any) -> bool:
        method = getattr(trainer, "_generate", None)
        if method is None:
            return False

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        trainer._generate = timed
        return True

    def take(self) -> float:
        value, self.total = self.total, 0.0
        return value


def _cpu_peak_rss_gib() -> float:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class TrialMetricsCallback:  # a transformers.TrainerCallback, made so in make_metrics_callback
    """Writes one metrics line (docs/trial-contract.md) per optimizer step to the metrics file (main process).

    * ``step_time``: wall seconds between the ends of successive optimizer steps (the first from
      its start): everything the step costs, dataloader and logging included.
    * ``samples``: completions trained in the step = per-device batch x accumulation x processes.
    * ``tokens``: prompt + completion tokens of the step, from the growth of TRL's ``num_tokens``
      (tokens seen, summed over processes) when it grew, else computed from the lengths.
    * ``peak_memory_gib``: on CUDA the larger of ``torch.cuda.max_memory_reserved`` and the
      device's used memory at the step end (which also counts a colocated vLLM engine and the
      CUDA context), largest over ranks; ``torch_peak_reserved_gib`` keeps the allocator's figure.
      On CPU the peak RSS of the process, largest over ranks (``memory_kind`` says which).
    * ``generation_time`` / ``training_time``: time in TRL's ``_generate`` and the rest of the step.

    Memory is reduced across ranks in ``on_step_end`` (every rank runs it); the line is written
    in ``on_log`` of the same step so TRL's figures can join it, or at the next step end when no
    log came.
    """

    def __init__(
        self,
        metrics_file: Path | None,
        samples_per_step: int,
        tokens_per_sample: int,
        device: str,
        timer: _GenerationTimer,
    ) -> None:
        self.metrics_file = metrics_file
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.device = device
        self.timer = timer
        self._last_end: float | None = None
        self._last_num_tokens: float | None = None
        self._pending: dict[str, Any] | None = None
        self._max_device_used = 0.0

    # -- events -----------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._last_end is None:
            self._last_end = time.perf_counter()
            self.timer.take()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        step_time = now - (self._last_end if self._last_end is not None else now)
        self._last_end = now
        generation_time = self.timer.take()
        memory = self._memory(args.device)
        if not state.is_world_process_zero:
            return
        self._flush()
        line: dict[str, Any] = {
            "step": int(state.global_step),
            "step_time": round(step_time, 6),
            "samples": self.samples_per_step,
            "tokens": self.samples_per_step * self.tokens_per_sample,
            **memory,
            "generation_time": round(generation_time, 6),
            "training_time": round(max(step_time - generation_time, 0.0), 6),
        }
        self._pending = line

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or self._pending is None or not logs:
            return
        line = self._pending
        num_tokens = logs.get("num_tokens")
        if isinstance(num_tokens, (int, float)) and not math.isnan(num_tokens):
            if self._last_num_tokens is not None and num_tokens > self._last_num_tokens:
                line["tokens"] = int(num_tokens - self._last_num_tokens)
            self._last_num_tokens = float(num_tokens)
        for key, name in (
            ("completions/mean_length", "completion_length"),
            ("completions/clipped_ratio", "clipped_ratio"),
        ):
            if isinstance(logs.get(key), (int, float)):
                line[name] = logs[key]
        self._flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self._flush()

    # -- helpers ----------------------------------------------------------------------------
    def _memory(self, device: Any) -> dict[str, Any]:
        if self.device == "cuda":
            import torch

            reserved = torch.cuda.max_memory_reserved(device) / GIB
            free, total = torch.cuda.mem_get_info(device)
            self._max_device_used = max(self._max_device_used, (total - free) / GIB)
            reserved, used = _max_over_ranks([reserved, self._max_device_used], device)
            return {
                "peak_memory_gib": round(max(reserved, used), 3),
                "torch_peak_reserved_gib": round(reserved, 3),
                "memory_kind": "cuda",
            }
        (rss,) = _max_over_ranks([_cpu_peak_rss_gib()], "cpu")
        return {"peak_memory_gib": round(rss, 3), "memory_kind": "host_rss"}

    def _flush(self) -> None:
        if self._pending is None:
            return
        line, self._pending = self._pending, None
        if self.metrics_file is None:
            return
        with open(self.metrics_file, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


def make_metrics_callback(*args: Any, **kwargs: Any) -> Any:
    """A :class:`TrialMetricsCallback` that is also a ``transformers.TrainerCallback``.

    The class is mixed in here so that importing this module does not import transformers.
    """
    from transformers import TrainerCallback

    cls = type("TrialMetricsTrainerCallback", (TrialMetricsCallback, TrainerCallback), {})
    return cls(*args, **kwargs)
