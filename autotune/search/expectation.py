"""What a candidate is expected to run at: the speed side of the planner.

The planner (:mod:`autotune.search.planner`) decides whether a candidate fits; this mixin says how
fast it should run. The speed prior (``autotune.candidate.speed``) ranks the whole grid before any
trial; once trials have run, each candidate's prior is corrected by the measured/prior ratio of the
nearest measured successes, and odds are taken off for clean CUDA OOMs it resembles. The convergence
test asks whether any untried candidate could still beat the best by more than the noise.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.candidate.estimate import prior_for
from autotune.candidate.moves import knobs_apart
from autotune.candidate.vector import at_least, distance

if TYPE_CHECKING:
    from autotune.candidate.memo import Memo
    from autotune.hardware import GpuType
    from autotune.models import ModelSpec
    from autotune.recipe import Recipe
    from autotune.search.knobs import KnobMemory

NEAREST = 3  # measured trials that correct the speed prior of a candidate
#: The prior's log error that :meth:`SpeedExpectation.improvable` allows: half a standard deviation
#: of what was measured, never less than 5%; 50% while fewer than 3 trials say how wrong it is.
SPREAD_STDEVS, MIN_SPREAD, EARLY_SPREAD, SPREAD_TRIALS = 0.5, 1.05, 1.5, 3
BLIND = 0.03  # two candidates whose priors differ by at most this much the prior cannot tell apart
TWIN_PAIRS = 3  # twin pairs before their spread counts as the noise


class SpeedExpectation:
    """Expected throughput over the planner's trials seen (mixed into :class:`Planner`)."""

    model: ModelSpec
    recipe: Recipe
    gpu: GpuType
    use_model: bool
    seen: list[Any]  # the planner's Seen records (it imports this module)
    knobs: KnobMemory
    _memo: Memo
    # and the planner's vector(), seen_vectors() and verdict()

    def prior(self, params: dict[str, Any]) -> float:
        compute = lambda: prior_for(self.model, self.recipe, self.gpu, params)  # noqa: E731
        return self._memo.get("prior", (self.model, self.recipe, self.gpu), params, compute)

    def expected_throughput(self, params: dict[str, Any]) -> float:
        """The speed prior corrected by what was measured nearby (prior x the mean measured/prior
        ratio of the closest successful trials, in knob space), halved for each way of differing in
        unknown knobs from clean CUDA OOMs that need no more memory by every known knob: no proof,
        but odds (OOMs that all differ from it the same way are one piece of evidence, not many)."""
        vec, mine = self.vector(params), self.knobs.split(params)[1]
        ooms, ok = self.speed_evidence()
        ways = {
            frozenset(set(unknown) - set(mine))
            for other, unknown in ooms
            if unknown != mine and at_least(vec, other)
        }
        prior = self.prior(params) * 0.5 ** len(ways)
        if not ok:
            return prior
        nearest = heapq.nsmallest(NEAREST, ok, key=lambda t: distance(vec, t[0]))
        return prior * statistics.fmean(ratio for _, ratio in nearest)

    def twin_noise(self) -> float:
        """Run-to-run noise as the search's own one-knob pairs show it, 0 until :data:`TWIN_PAIRS`
        exist: the pairs the prior cannot tell apart (:data:`BLIND`; most of what a walk measures
        one knob at a time), whose throughputs differ by the noise of two runs plus whatever small
        effect the knob has (so an upper bound: the root mean square of their log ratios over
        the square root of two)."""

        def compute() -> float:
            ok = [s for s in self.seen if s.status == "ok" and s.throughput]
            gaps = []
            for i, a in enumerate(ok):
                for b in ok[i + 1 :]:
                    if knobs_apart(a.params, b.params) != 1:
                        continue
                    if abs(math.log(self.prior(a.params) / self.prior(b.params))) <= BLIND:
                        gaps.append(math.log(a.throughput / b.throughput) ** 2)
            return math.expm1(math.sqrt(statistics.fmean(gaps) / 2)) if len(gaps) >= TWIN_PAIRS else 0.0

        owners = (self.model, self.recipe, self.gpu, self.seen)
        return self._memo.get("twins", owners, {"n": len(self.seen)}, compute)

    def speed_evidence(
        self,
    ) -> tuple[list[tuple[tuple[float, ...], tuple]], list[tuple[tuple[float, ...], float]]]:
        """What :meth:`expected_throughput` reads of the trials seen, once per trial learned (the
        convergence test asks it of thousands of candidates): each clean CUDA OOM's memory vector
        and unknown knobs, each success's vector and measured/prior ratio."""

        def compute() -> tuple[list, list]:
            ooms = [
                (other, self.knobs.split(s.params)[1])
                for s, other in self.seen_vectors()
                if s.status == "oom" and s.oom_kind == "cuda" and not s.leftover
            ]
            ok = [
                (other, s.throughput / self.prior(s.params))
                for s, other in self.seen_vectors()
                if s.status == "ok" and s.throughput
            ]
            return ooms, ok

        owners = (self.model, self.recipe, self.gpu, self.knobs, self.seen)
        return self._memo.get("speed", owners, {"n": len(self.seen)}, compute)

    def improvable(
        self,
        pool: list[tuple[float, dict[str, Any]]],
        tried: set[str],
        key: Callable[[dict[str, Any]], str],
        best: float,
        noise: float,
    ) -> dict[str, Any] | None:
        """An untried candidate that could still beat ``best`` by more than ``noise``, or None.

        A candidate could win when its expected throughput (the prior corrected by the nearest
        measurements), raised by how far measurements have strayed from the prior, beats the
        incumbent by more than the noise, and nothing known rules it out as too big. The pool is
        sorted by prior, so the walk stops at the first prior that even the most favourable
        correction measured so far cannot lift over the bar.
        """
        ok = [s for s in self.seen if s.status == "ok" and s.throughput]
        if not ok or not self.use_model:
            return pool[0][1] if pool else None  # nothing to judge by: keep searching
        logs = [math.log(s.throughput / self.prior(s.params)) for s in ok]
        # half a standard deviation of the prior's log error, never less than 5%: the caller has
        # already waited out its patience, so this guards against a prior that is wrong nearby
        spread = (
            max(MIN_SPREAD, math.exp(SPREAD_STDEVS * statistics.pstdev(logs)))
            if len(logs) >= SPREAD_TRIALS
            else EARLY_SPREAD
        )
        ceiling = math.exp(max(logs)) * spread
        bar = best * (1 + noise)
        for prior, cand in pool:
            if prior * ceiling <= bar:
                return None
            if key(cand) in tried or self.expected_throughput(cand) * spread <= bar:
                continue
            if not self.verdict(cand).skip:
                return cand
        return None
