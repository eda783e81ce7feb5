"""What a candidate is expected to run at: the speed side of the planner.

The planner (:mod:`autotune.search.planner`) decides whether a candidate fits; this mixin says how
fast it should run. The speed prior (``autotune.candidate.speed``) ranks the whole grid before any
trial; once trials have run, each candidate's prior is corrected by what the measured successes
say of the prior's error, two ways (:meth:`SpeedExpectation.expected_throughput`), and odds are
taken off for clean CUDA OOMs it resembles. The convergence test asks whether any untried candidate
could still beat the best by more than the noise.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.candidate.estimate import prior_for
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
#: How hard the per-knob fit of the prior's error pulls each knob value's effect towards the mean
#: error: (run-to-run noise / a knob value's typical error)^2, about (5% / 10%)^2, so a value's
#: effect is n / (n + 0.25) of what its n runs showed apart from the rest: four fifths for one run.
RIDGE = 0.25


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
        """The speed prior corrected by what was measured, halved for each way of differing in
        unknown knobs from clean CUDA OOMs that need no more memory by every known knob: no proof,
        but odds (OOMs that all differ from it the same way are one piece of evidence, not many).

        The correction is the mean, in log space, of two views of the prior's error: nearby (the
        measured/prior ratio of the closest successes in knob space, which sees interactions a
        knob-by-knob view cannot) and knob by knob over every success (:class:`PriorError`, which
        carries an effect the prior misjudges, say offload's cost on this machine, to combinations
        nobody measured near), held within the errors the successes showed. Equal weights, not
        fitted: on the benchmark the knob-by-knob view alone did worse than the nearby view alone,
        and the two together, with :func:`autotune.search.trade.overshoot_saver`, better than either
        (docs/benchmarks-notes.md, seventeenth pass)."""
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
        fit = self.prior_error()
        if fit is None:
            return prior * statistics.fmean(ratio for _, ratio in nearest)
        near = statistics.fmean(math.log(ratio) for _, ratio in nearest)
        # within what was measured: a sum of effects can extrapolate past every success's error,
        # and improvable() walks the pool only while no expectation can beat the best measured ratio
        logs = [math.log(ratio) for _, ratio in ok]
        knob_by_knob = min(max(fit.log_error(params), min(logs)), max(logs))
        return prior * math.exp(0.5 * knob_by_knob + 0.5 * near)

    def prior_error(self) -> PriorError | None:
        """The prior's log error fitted per knob value over every measured success (None before
        two): see :class:`PriorError`. Fitted once per trial learned."""

        def compute() -> PriorError | None:
            ok = [s for s in self.seen if s.status == "ok" and s.throughput]
            return PriorError.fit([(s.params, math.log(s.throughput / self.prior(s.params))) for s in ok])

        owners = (self.model, self.recipe, self.gpu, self.seen)
        return self._memo.get("prior_error", owners, {"n": len(self.seen)}, compute)

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

        A candidate could win when its expected throughput (the prior corrected by what was
        measured, :meth:`expected_throughput`), raised by how far measurements have strayed from
        the prior, beats the incumbent by more than the noise, and nothing known rules it out as too
        big. The pool is sorted by prior, so the walk stops at the first prior that even the most
        favourable correction measured so far cannot lift over the bar (no expectation corrects a
        prior by more than the largest error a success showed).
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


def _level(value: Any) -> Any:
    """A knob value as a key of :class:`PriorError` (floats rounded, as the grid spaces them)."""
    return round(value, 6) if isinstance(value, float) else value


@dataclass(frozen=True)
class PriorError:
    """The speed prior's log error as a mean plus one effect per knob value: a ridge fit of
    log(measured / prior) on the knobs' values (one-hot), over every measured success.

    The prior is physics with a machine's constants guessed; where one of its terms is off by a
    factor (offload's transfers slower, generation faster, sleep mode's reload dearer), every trial
    holding that knob value shows it, wherever in the space it ran. Values every success shares
    carry nothing a mean does not; a value never measured gets no effect (the prior's word stands).
    The ridge (:data:`RIDGE`) shrinks each effect toward zero by how few runs show it. The table of
    effects is read-only.
    """

    mean: float
    effects: Mapping[tuple[str, Any], float]

    def log_error(self, params: dict[str, Any]) -> float:
        return self.mean + sum(self.effects.get((k, _level(v)), 0.0) for k, v in params.items())

    @classmethod
    def fit(cls, data: list[tuple[dict[str, Any], float]], ridge: float = RIDGE) -> PriorError | None:
        """Fitted to (params, log error) pairs; None before two."""
        if len(data) < 2:
            return None
        y = np.array([err for _, err in data])
        levels = sorted({(k, _level(v)) for params, _ in data for k, v in params.items()}, key=repr)
        levels = [
            (k, v)
            for k, v in levels
            if 0 < sum(1 for params, _ in data if _level(params.get(k)) == v) < len(data)
        ]
        mean = float(y.mean())
        if not levels:
            return cls(mean, MappingProxyType({}))
        column = {level: j for j, level in enumerate(levels)}
        x = np.zeros((len(data), len(levels)))
        for i, (params, _) in enumerate(data):
            for k, v in params.items():
                j = column.get((k, _level(v)))
                if j is not None:
                    x[i, j] = 1.0
        w = np.linalg.solve(x.T @ x + ridge * np.eye(len(levels)), x.T @ (y - mean))
        return cls(mean, MappingProxyType({level: float(w[j]) for level, j in column.items()}))
