"""Showing a search as it runs: a live rich view on a terminal, plain lines otherwise.

Both reporters receive the same events from the controller; neither influences the search.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from autotune.study.record import low_util_diagnosis
from autotune.trial.metrics import StepRecord
from autotune.trial.outcome import Outcome

SHORT = {
    "per_device_train_batch_size": "bs",
    "gradient_accumulation_steps": "ga",
    "num_generations": "G",
    "zero_stage": "zero",
    "offload": "off",
    "gradient_checkpointing": "gc",
    "use_vllm": "vllm",
    "vllm_mode": "mode",
    "vllm_gpu_memory_utilization": "vmem",
    "vllm_enable_sleep_mode": "sleep",
    "vllm_tensor_parallel_size": "tp",
}


def short_params(params: dict[str, Any]) -> str:
    """A compact one-line form of a candidate for progress lines."""
    parts = []
    for name, value in params.items():
        if isinstance(value, bool):
            value = "y" if value else "n"
        elif isinstance(value, float):
            value = f"{value:.2f}"
        parts.append(f"{SHORT.get(name, name)}={value}")
    return " ".join(parts)


def describe(outcome: Outcome) -> str:
    if outcome.status == "ok":
        peak = f", peak {outcome.peak_memory_gib:.1f} GiB" if outcome.peak_memory_gib else ""
        # a fast-looking trial whose GPUs idled is worth seeing while the search runs
        low = low_util_diagnosis(outcome)
        return f"ok {outcome.throughput:.3g} completions/s{peak}" + (f"; low GPU use: {low}" if low else "")
    if outcome.status == "oom":
        return f"oom/{outcome.oom_kind}"
    line = outcome.error_line or outcome.detail or ""
    return f"{outcome.status}: {line[:120]}" if line else outcome.status


class Reporter:
    """Plain lines, one per event worth a line (also the base for the live view)."""

    def __init__(self, total: int, stream=None) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.best: tuple[int, float] | None = None

    def elapsed(self) -> str:
        s = int(time.monotonic() - self.start)
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"

    def emit(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        self.emit(text)

    def trial_started(self, number: int, launched: int, params: dict[str, Any]) -> None:
        self.emit(f"[{self.elapsed()}] trial {number} ({launched}/{self.total}) {short_params(params)}")

    def step(self, number: int, record: StepRecord) -> None:
        pass

    def not_launched(self, number: int, params: dict[str, Any], status: str, reason: str) -> None:
        self.emit(f"[{self.elapsed()}] trial {number} {status}: {reason}")

    def trial_finished(self, number: int, outcome: Outcome) -> None:
        if (
            outcome.status == "ok"
            and outcome.throughput
            and (self.best is None or outcome.throughput > self.best[1])
        ):
            self.best = (number, outcome.throughput)
        best = f"  best so far: trial {self.best[0]} {self.best[1]:.3g}/s" if self.best else ""
        self.emit(f"[{self.elapsed()}] trial {number} {describe(outcome)}{best}")

    def close(self) -> None:
        pass


class LiveReporter(Reporter):
    """A rich live panel: the trial now running, its step, the best so far, recent results."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        super().__init__(total)
        self.console = console or Console()
        self.current: str = "starting"
        self.current_step = ""
        self.recent: list[str] = []
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def _render(self) -> Group:
        table = Table.grid(padding=(0, 1))
        table.add_row(Text("elapsed", style="bold"), self.elapsed())
        table.add_row(Text("trial", style="bold"), self.current)
        table.add_row(Text("step", style="bold"), self.current_step or "-")
        best = f"trial {self.best[0]}: {self.best[1]:.3g} completions/s" if self.best else "-"
        table.add_row(Text("best", style="bold green"), best)
        recent = Text("\n".join(self.recent[-8:]))
        return Group(table, recent)

    def emit(self, text: str) -> None:
        self.recent.append(text)
        self.live.update(self._render())

    def trial_started(self, number: int, launched: int, params: dict[str, Any]) -> None:
        self.current = f"{number} ({launched}/{self.total}) {short_params(params)}"
        self.current_step = ""
        self.live.update(self._render())

    def step(self, number: int, record: StepRecord) -> None:
        t = f"{record.step_time:.1f}s" if record.step_time else "?"
        self.current_step = f"{record.step} ({t})"
        self.live.update(self._render())

    def close(self) -> None:
        self.live.update(self._render())
        self.live.stop()


def make_reporter(total: int) -> Reporter:
    if sys.stdout.isatty():
        return LiveReporter(total)
    return Reporter(total)
