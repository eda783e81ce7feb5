"""When a running trial has told us enough: measured, or clearly not worth finishing.

A trial exists to measure steady-state throughput. Once the step times after warm-up agree with
each other, more steps only burn GPU time; and a trial whose first measured steps are far slower
than the best configuration so far cannot win, so it is pruned (reported through Optuna's pruner
interface, so the sampler sees it as a pruned trial). Where the study knows how far one step's time
moves from the next (its step noise, pooled over its trials), a trial below the best by more than
twice what its steps so far could be off is measured: more steps average only that noise, and
would not lift it to the best. A confirmation run is measured in full, except a runner-up's that is
out of reach of what it must reach to win the choice (its ``bar``). An OOM ends a trial by itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.recipe import Recipe
from autotune.trial.metrics import StepRecord, steady_throughput

CONFIRM_FACTOR = 3  # a confirmation run measures this many times the usual steps


@dataclass
class StopRule:
    """Decides from the step records so far: None (go on), 'measured' or 'pruned'."""

    warmup: int = 2
    measure: int = 3  # measured steps in the usual case
    adaptive: bool = True  # stop at min_measured when the spread is already small
    min_measured: int = 2
    spread: float = 0.05  # (max - min) / mean of measured step times counts as stable
    extra: int = 3  # an unstable trial may measure this many more steps
    prune: bool = True

    @classmethod
    def searching(cls, recipe: Recipe) -> StopRule:
        """A search trial: adaptive (stops once stable) and prunable."""
        return cls(warmup=recipe.warmup_steps, measure=recipe.measure_steps)

    @classmethod
    def confirming(cls, recipe: Recipe) -> StopRule:
        """A confirmation run: :data:`CONFIRM_FACTOR` times the measured steps, all of them (but for
        a runner-up's out of reach of winning, which :class:`TrialControl` stops by its ``bar``)."""
        return cls(
            warmup=recipe.warmup_steps,
            measure=recipe.measure_steps * CONFIRM_FACTOR,
            adaptive=False,
            prune=False,
        )

    def measured(self, records: list[StepRecord]) -> list[float]:
        return [r.step_time for r in records if r.step > self.warmup and r.step_time]

    def stable(self, times: list[float]) -> bool:
        if len(times) < 2:
            return False
        mean = statistics.fmean(times)
        return mean > 0 and (max(times) - min(times)) / mean <= self.spread

    def decide(self, records: list[StepRecord], steps_done: int) -> str | None:
        after = steps_done - self.warmup
        if after <= 0:
            return None
        times = self.measured(records)
        if self.adaptive and after >= self.min_measured and self.stable(times[-self.min_measured :]):
            return "measured"
        if after >= self.measure and (not self.adaptive or self.stable(times[-self.measure :])):
            return "measured"
        if after >= self.measure + (self.extra if self.adaptive else 0):
            return "measured"
        return None


@dataclass
class TrialControl:
    """What a running trial consults at every step: its stop rule, how far it is from the best by its
    steps' noise (:meth:`out_of_reach`) and Optuna's pruner.

    ``trial`` is the Optuna trial to report intermediate throughput to (None for confirmation and
    verify runs, which are never pruned); ``purpose`` says which kind of run this is.
    """

    rule: StopRule
    trial: Any | None = None  # optuna.Trial: report() / should_prune(), its study's best
    samples_per_step: int | None = None
    on_step: Callable[[StepRecord], None] = lambda record: None
    purpose: str = "search"  # search | confirm | verify
    # one step's relative spread (sd of log step time), pooled over the study's trials
    # (study.ranking.step_noise); None until enough trials measured it: nothing is cut for it
    step_noise: float | None = None
    # a runner-up's confirmation: the throughput it must reach to win the choice
    # (search.confirm.runner_up_bar); None: measured in full
    bar: float | None = None
    # log(second / first) of the first two measured steps, once seen: what the study pools
    first_pair: float | None = field(default=None, init=False)
    cut: bool = field(default=False, init=False)  # stopped by out_of_reach, before its steps were done

    def decide(self, records: list[StepRecord], steps_done: int) -> str | None:
        times = self.rule.measured(records)
        if self.first_pair is None:
            self.first_pair = first_pair(records, self.rule.warmup)
        verdict = self.rule.decide(records, steps_done)
        if verdict is None and self.out_of_reach(records, len(times)):
            self.cut = True
            return "measured"
        if verdict is None and self.rule.prune and self.trial is not None and steps_done > self.rule.warmup:
            value = steady_throughput(records, self.rule.warmup, self.samples_per_step)
            if value:
                self.trial.report(value, steps_done)
                if self.trial.should_prune():
                    return "pruned"
        return verdict

    def out_of_reach(self, records: list[StepRecord], measured: int) -> bool:
        """Whether the run's throughput so far is below its bar by more than twice its standard
        error from step noise (``step_noise`` over the ``measured`` steps): more steps would not
        lift it there. The bar of a prunable search trial is Optuna's best that fits (the pruner's);
        a runner-up's confirmation has the one it was given (``bar``). Nothing is cut before the
        study knows its step noise, nor a run with no bar (the first confirmation, a verify run)."""
        if not (self.step_noise and measured >= 1):
            return False
        bar = self.bar
        if bar is None and self.rule.prune and self.trial is not None:
            try:
                bar = self.trial.study.best_trial.value  # Optuna's best that fits, as the pruner's bar
            except ValueError:  # nothing measured that fits yet
                return False
        value = steady_throughput(records, self.rule.warmup, self.samples_per_step)
        return bool(bar and value) and value * math.exp(2 * self.step_noise / math.sqrt(measured)) < bar


def first_pair(records: list[StepRecord], warmup: int) -> float | None:
    """log(t2 / t1) of the first two measured steps, each a single step, else None. A trial that
    measures two steps has this pair whatever it then does, where later pairs are of trials the steady
    stop kept going for their spread: pooled over trials it estimates one step's noise without that
    bias (only trials whose first measured step was not already out of reach, or pruned, give one)."""
    post = [r for r in records if r.step > warmup][:2]
    if len(post) < 2 or any(r.span != 1 or not r.step_time or r.step_time <= 0 for r in post):
        return None
    if post[1].step != post[0].step + 1:
        return None
    return math.log(post[1].step_time / post[0].step_time)  # type: ignore[operator]
