"""Runners turn one candidate into a command, an environment and files.

A runner knows one kind of trainer: ``sim`` (the simulated GRPO trainer), ``command`` (any
trainer through a command template), ``trl`` (TRL's GRPOTrainer) and ``swift`` (ms-swift's
``swift rlhf --rlhf_type grpo``). The launcher, monitor and study treat them all alike through
:class:`Runner`.
"""

from __future__ import annotations

from autotune.errors import UsageError
from autotune.runners.base import Runner, TrialContext

RUNNERS = ("trl", "sim", "command", "swift")


def make_runner(context: TrialContext) -> Runner:
    """The runner the recipe names, checked so bad setups fail before the first trial."""
    name = context.recipe.runner
    if name == "sim":
        from autotune.runners.sim import SimRunner

        runner: Runner = SimRunner(context)
    elif name == "command":
        from autotune.runners.command import CommandRunner

        runner = CommandRunner(context)
    elif name == "swift":
        from autotune.runners.swift import SwiftRunner

        runner = SwiftRunner(context)
    elif name == "trl":
        from autotune.runners.trl import TrlRunner

        runner = TrlRunner(context)
    else:
        raise UsageError(f"unknown runner '{name}': use one of {', '.join(RUNNERS)}")
    runner.check()
    return runner


__all__ = ["RUNNERS", "Runner", "TrialContext", "make_runner"]
