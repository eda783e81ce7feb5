"""Simulated GRPO trainer (``--runner sim``): rehearse a search, test and benchmark without GPUs.

``landscape`` is the ground truth (pure, fast, deterministic), fed by ``scenario`` (spec parsing),
``truth`` (result types) and ``generation`` (engine generation time); ``trainer`` is the fake trainer
process that plays one trial of it with realistic logs, metrics and failures, whose texts
``error_text`` renders. ``replay`` steps the same truth in-process for the benchmark.
"""

from autotune.sim.landscape import Failure, SpecError, TrialTruth, evaluate, parse_spec

__all__ = ["Failure", "SpecError", "TrialTruth", "evaluate", "parse_spec"]
