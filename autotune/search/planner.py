"""The planner sits between the sampler and the launcher: feasible? predicted peak? worth running?

It combines three kinds of knowledge, cheapest first:
1. what trials have shown: a candidate that needs at least as much memory as a measured OOM in
   every memory-raising knob will OOM too (skip it); one that needs no more than a measured success
   fits (never skip it on the model's word);
2. the memory model (``autotune.candidate.memory``), calibrated by per-part corrections fitted to
   every measured peak, so its error shrinks as the night goes on (OOMs teach through dominance, above);
3. a speed prior (``autotune.candidate.speed``) to rank the candidates the model expects to fit, so the
   first trials of a study are already good ones, corrected by what was measured nearby
   (:mod:`autotune.search.expectation`, the speed side, mixed into :class:`Planner`).
Skipped candidates cost no GPU time and are told to Optuna as infeasible, like OOMs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.defaults import knob
from autotune.candidate.estimate import estimate_for
from autotune.candidate.memo import Memo
from autotune.candidate.memory import Estimate
from autotune.candidate.moves import neighbors
from autotune.candidate.space import Space
from autotune.candidate.vector import OFFLOAD_RANK, MemoryVector, at_least, memory_vector
from autotune.hardware import GpuType
from autotune.models import ModelSpec
from autotune.recipe import Recipe
from autotune.search.expectation import SpeedExpectation
from autotune.search.knobs import KnobMemory, fraction_knob, learn, vllm_beside_trainer
from autotune.search.refusals import Refusals
from autotune.search.trust import ModelTrust
from autotune.study.ranking import headroom_limit

log = logging.getLogger(__name__)

#: The parts calibration fits a correction to (the features of :class:`Estimate`).
CALIBRATED_PARTS = ("model_states", "activations", "logits", "vllm", "overhead")
RIDGE = 1.0  # how hard calibration pulls each correction towards 1.0
CORRECTION_BOUNDS = (0.3, 3.0)  # a part is never trusted below 0.3x or above 3x the model
GRID_FLOAT_POINTS = 5  # values of each continuous knob in the candidate pool


KEPT: dict[str, Any] = {"init": False, "repr": False, "compare": False}  # a field that is a cache


def larger_first(cand: dict[str, Any], names: Iterable[str]) -> tuple[int, ...]:
    """A sort key that puts each integer knob's larger value first (switches, categories and floats
    tie, and keep the order listed): how the pool breaks the prior's ties."""
    return tuple(-v if type(v) is int else 0 for v in (cand.get(n) for n in names))


@dataclass
class Verdict:
    skip: bool
    reason: str | None
    predicted_gib: float | None


@dataclass
class Seen:
    number: int
    params: dict[str, Any]
    status: str
    oom_kind: str | None
    peak_gib: float | None
    throughput: float | None = None
    leftover: bool = False  # started on GPUs still holding an earlier trial's memory


@dataclass
class Planner(SpeedExpectation, ModelTrust):
    """Decides, before launch, whether a candidate is worth a trial."""

    model: ModelSpec
    recipe: Recipe
    gpu: GpuType
    margin: float = 0.10  # skip only when predicted above capacity by this much
    unexplored_margin: float = 0.30  # ... where it extrapolates (search/trust.py: veto_margin)
    use_model: bool = True  # off for CPU trials (the model describes GPU memory)
    seen: list[Seen] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)  # per-part corrections
    _turn: int = 0  # which knob the local search moves next
    rel_error: float = 0.25  # typical |measured - predicted| / measured after calibration
    knobs: KnobMemory = field(default_factory=KnobMemory)  # which knobs' memory effect is known
    refusals: Refusals = field(default_factory=Refusals)  # values the trainer refused by name
    # successes a longer run took from the export (a confirmation that died or peaked inside the
    # headroom, a production run lost): never the incumbent, nor a centre of the walk
    passed_over: set[int] = field(default_factory=set)
    # what is kept between calls (the grid is 48,720 candidates for a 7B on 4 GPUs: never printed)
    _memo: Memo = field(default_factory=Memo, init=False, repr=False, compare=False)  # vector(), prior()
    _pool: list[tuple[float, dict[str, Any]]] | None = field(default=None, **KEPT)
    # (the pool, recipe and model it was estimated for), and per entry: raw GiB, whether vLLM cannot
    # start; its parts
    _estimated: tuple[tuple, list[tuple[float, bool]], Any] | None = field(default=None, **KEPT)
    # the pool, and the open candidate of it the last exhaustion test found
    open_hint: tuple[list, dict[str, Any] | None] | None = field(default=None, **KEPT)
    # the pool, and its candidates' indices leanest first with their scores (search.cures.lean_order)
    lean: tuple[list, list[tuple[float, int]]] | None = field(default=None, **KEPT)

    # -- predictions ------------------------------------------------------------------------
    def raw(self, params: dict[str, Any]) -> Estimate:
        """The uncalibrated estimate, as ``autotune estimate`` prints it."""
        return estimate_for(self.model, self.recipe, params)

    def predict(self, params: dict[str, Any]) -> float:
        """Calibrated peak GiB per GPU: each part times its learned correction."""
        est = self.raw(params)
        if not self.weights:
            return est.total_gib
        return sum(self.weights.get(k, 1.0) * v for k, v in est.features.items())

    # -- learning ---------------------------------------------------------------------------
    def observe(
        self,
        number: int,
        params: dict[str, Any],
        status: str,
        oom_kind: str | None,
        peak_gib: float | None,
        throughput: float | None = None,
        leftover: bool = False,
    ) -> None:
        self.seen.append(Seen(number, dict(params), status, oom_kind, peak_gib, throughput, leftover))
        self._memo.clear()  # bounded by one step's questions, not the grid's size
        self.knobs = learn(self.knobs, self.seen)  # directions of unknown knobs that trials showed
        self.calibrate()

    def vector(self, params: dict[str, Any], knobs: KnobMemory | None = None) -> tuple[float, ...]:
        """The memory vector over TRL's names, then the knobs whose direction is known (``knobs``:
        another view of what is known than the planner's)."""
        if knobs is not None:
            return self._vector(params, knobs)
        owners = (self.recipe, self.knobs)
        return self._memo.get("vector", owners, params, lambda: self._vector(params, self.knobs))

    def seen_vectors(self) -> list[tuple[Seen, tuple[float, ...]]]:
        """Each trial seen with its memory vector (computed again once a trial or a knob is learned)."""
        compute = lambda: [(s, self.vector(s.params)) for s in self.seen]  # noqa: E731
        return self._memo.get("seen", (self.recipe, self.knobs, self.seen), {"n": len(self.seen)}, compute)

    def _vector(self, params: dict[str, Any], knobs: KnobMemory) -> tuple[float, ...]:
        extra, _ = knobs.split(params)
        trl = constraints.as_trl(params, self.recipe)
        return memory_vector(trl, self.recipe.dp_gpus(trl)) + extra

    def expected_to_fit(self, params: dict[str, Any]) -> bool:
        """Whether the calibrated model, where it may judge, expects ``params`` to keep the
        headroom free (True where it may not judge: no veto without a trusted model)."""
        if not (self.use_model and self.model_trusted):
            return True
        return self.plausible(params)

    def plausible(self, params: dict[str, Any]) -> bool:
        """Whether the model, once a measured peak has calibrated it, puts ``params`` inside the
        headroom (True before): on its own an order to try candidates in, never a veto
        (:meth:`expected_to_fit` applies it only once the model is trusted). A model that does not
        know the trainer may not skip for it until several of its peaks agree (a --command trainer
        may keep four models or quantize), but calibrated by one, predicting 300 GiB on 24 GiB
        cards, it knows what to try first: without it the grid's best open candidate of PPO 1.5B on
        8 x 24 GB was the prior's fastest, micro-batch 16, five times in one search after a peak had
        calibrated the model, and each ran out of memory. Before any peak it says nothing: the raw
        model of a trainer it does not describe, never corrected where no peak is ever measured,
        held the grid's pick to micro-batch 4 in a search whose best ran micro-batch 16."""
        if not (self.use_model and self.weights):
            return True
        return self.predict(params) <= (headroom_limit(self.recipe) or math.inf)

    def calibrate(self) -> None:
        """Per-part corrections fitted to every measured peak.

        Ridge regression of measured peaks on the model's parts (model states, activations,
        logits, vLLM, overhead), pulled towards 1.0 so a handful of trials cannot send a part the
        data barely constrains to nonsense. The remaining relative error widens the skip margin:
        the model vetoes only what it is sure about given how wrong it has been.
        """
        if not self.use_model:
            return
        import numpy as np

        obs = [
            (self.raw(s.params).features, s.peak_gib) for s in self.seen if s.status == "ok" and s.peak_gib
        ]
        if not obs:
            return
        names = list(CALIBRATED_PARTS)
        X = np.array([[f.get(n, 0.0) for n in names] for f, _ in obs])
        y = np.array([peak for _, peak in obs])
        scale = np.maximum((X**2).mean(axis=0), 1e-6)
        lam = RIDGE
        A = X.T @ X + lam * np.diag(scale)
        b = X.T @ y + lam * scale
        w = np.clip(np.linalg.solve(A, b), *CORRECTION_BOUNDS)
        self.weights = dict(zip(names, map(float, w)))
        errors = [
            abs(self.predict(s.params) - s.peak_gib) / s.peak_gib
            for s in self.seen
            if s.status == "ok" and s.peak_gib
        ]
        self.rel_error = float(np.sqrt(np.mean(np.square(errors))))

    # -- decisions --------------------------------------------------------------------------
    def verdict(self, params: dict[str, Any]) -> Verdict:
        """Skip or run, in the order of the evidence's strength.

        First a success whose measured peak left less than the headroom free: a candidate that
        needs at least its memory in every knob could never be exported, so it is not worth a trial.
        Then a measured success that needs at least as much memory in every knob proves the candidate
        fits, so it is never skipped, whatever an OOM or the model says (an OOM it contradicts was
        noise, or another trial's leftovers). Then a measured OOM that the candidate dominates in
        the knobs that kind of failure depends on; an OOM that started on GPUs still holding an
        earlier trial's memory proves nothing and is not used. Last, the calibrated model. Before
        all of them, a value the trainer refused by name (:mod:`autotune.search.refusals`).
        """
        vec = self.vector(params)
        predicted = self.predict(params) if self.use_model else None
        refused = self.refusals.reason(params, (s.params for s in self.seen if s.status == "ok"))
        if refused:
            return Verdict(True, refused, predicted)
        limit = headroom_limit(self.recipe) or math.inf
        ok = [(s, v) for s, v in self.seen_vectors() if s.status == "ok"]
        for s, other in ok:
            if (s.peak_gib or 0.0) > limit and not s.leftover and at_least(vec, other):
                if self.knobs.same_unknown(s.params, params):
                    why = f"needs at least the memory of trial {s.number}, which peaked inside the headroom"
                    return Verdict(True, why, predicted)
        if any(at_least(other, vec) and self.knobs.same_unknown(s.params, params) for s, other in ok):
            return Verdict(False, None, predicted)  # fits surely
        for s in self.seen:
            if s.status == "oom" and not s.leftover and self._dominates_oom(params, vec, s):
                why = f"needs at least the memory of trial {s.number}, which hit oom/{s.oom_kind}"
                return Verdict(True, why, predicted)
        # the model only vetoes once a measured peak has anchored it: an uncalibrated model that
        # is wrong for this trainer (a --command trainer with its own tricks) must not veto
        # every candidate before a single trial has run
        if predicted is None or not self.model_trusted:
            return Verdict(False, None, predicted)
        if not self.reads(params):  # calibrated only at other settings of knobs it cannot read
            return Verdict(False, None, predicted)
        cap = self.recipe.gpu_memory_gib
        margin = self.veto_margin(params)
        if predicted > cap * (1 + margin):
            return Verdict(
                True,
                f"predicted {predicted:.1f} GiB per GPU > {cap:.1f} GiB capacity (+{margin:.0%} margin)",
                predicted,
            )
        return Verdict(False, None, predicted)

    def needs_at_least(self, params: dict[str, Any], other: dict[str, Any], kind: str) -> bool:
        """Whether ``params`` would die of the ``kind`` OOM ``other`` died of (a restart's choice)."""
        return self._dominates_oom(params, self.vector(params), Seen(0, other, "oom", kind, None))

    def _dominates_oom(self, params: dict[str, Any], vec: tuple[float, ...], s: Seen) -> bool:
        """Whether ``params`` needs at least what OOM trial ``s`` needed, in the knobs its kind of
        failure depends on (each a different resource):

        - cuda: the trainer's peak, every knob;
        - vllm_kv: the KV cache vLLM finds left = fraction x capacity - weights / TP, so a smaller
          or equal fraction at an equal or smaller TP fails too; the batch does not matter;
        - vllm_startup: vLLM asks for fraction x total while the trainer already holds its states,
          so an equal or larger fraction beside as much trainer state (ZeRO stage, offload, the
          data-parallel size that shards it) fails too; the batch does not matter;
        - host: host RAM, which on GPUs holds offloaded states (CPU trials: every knob).
        """
        if not self.knobs.same_unknown(params, s.params):
            return False  # a knob whose effect on memory is unknown differs: the OOM says nothing
        other = self.vector(s.params)
        colocated = vllm_beside_trainer(params)
        fraction = float(params.get(fraction_knob(params) or "", 0) or 0)
        seen_fraction = float(s.params.get(fraction_knob(s.params) or "", 0) or 0)
        if s.oom_kind == "cuda":
            return at_least(vec, other)
        if s.oom_kind == "vllm_kv":
            return (
                colocated
                and fraction <= seen_fraction + 1e-9
                and int(knob(params, "vllm_tensor_parallel_size"))
                <= int(knob(s.params, "vllm_tensor_parallel_size"))
            )
        # the TRL knobs by name (a space's declared knobs follow them in the vector: as much trainer
        # state in each of them too, for a start-up failure)
        n = len(MemoryVector._fields)
        extra, other_extra = vec[n:], other[n:]
        vec, other = MemoryVector._make(vec[:n]), MemoryVector._make(other[:n])
        if s.oom_kind == "vllm_startup":
            return (
                colocated
                and all(x >= y - 1e-9 for x, y in zip(extra, other_extra))
                and fraction >= seen_fraction - 1e-9
                and vec.zero_stage >= other.zero_stage
                and vec.offload >= other.offload
                and vec.dp >= other.dp
            )
        if s.oom_kind == "host":
            if self.recipe.device == "cpu":  # on CPU trials host RAM is the device memory
                return at_least(vec, other)
            # on GPUs host RAM holds offloaded states: as large a batch with as much offload
            return (
                params.get("zero_stage") == s.params.get("zero_stage")
                and vec.micro_batch >= other.micro_batch
                and OFFLOAD_RANK.get(params.get("offload", "none"), 2)
                <= OFFLOAD_RANK.get(s.params.get("offload", "none"), 2)
            )
        return False

    def next_local(
        self,
        incumbent: dict[str, Any],
        space: Space,
        fixed: dict[str, Any],
        rules: Iterable[Callable[[dict[str, Any]], str | None]],
        tried: set[str],
        key: Callable[[dict[str, Any]], str],
        flat: set[str] | frozenset[str] = frozenset(),
    ) -> dict[str, Any] | None:
        """The untried neighbour of the incumbent the planner would run, best prior first; knobs
        measured to change nothing (``flat``) get no turn of their own."""
        options = [
            c
            for c in neighbors(incumbent, space, fixed, self.recipe, rules)
            if key(c) not in tried and not self.verdict(c).skip
        ]
        if not options:
            return None
        # take the knobs in turn, so that a prior that is wrong about one knob (say, the cost of
        # recomputation) cannot keep the search away from that direction for the whole night
        knobs = [n for n in space.params if n not in fixed and n not in flat] or [
            n for n in space.params if n not in fixed
        ]
        # a tie the prior cannot read goes to the neighbour that spends memory (what memory buys is
        # speed), only where peaks are measured: without them the edge it nears is not seen, and a
        # configuration there held its trials and died in the long run (docs/benchmarks-notes.md);
        # what still ties goes up an integer knob of unknown effect (a TP degree), not the list's way
        lean = any(s.status == "ok" and s.peak_gib is not None for s in self.seen)

        def rank(c: dict[str, Any]) -> tuple[float, int, int]:
            spends = self.knobs.spends(c, incumbent) if lean else 0
            return self.expected_throughput(c), spends, self.knobs.rises(c, incumbent)

        for _ in range(len(knobs)):
            knob = knobs[self._turn % len(knobs)]
            self._turn += 1
            group = [c for c in options if c.get(knob) != incumbent.get(knob)]
            if group:
                return max(group, key=rank)
        return max(options, key=rank)

    # -- the candidate pool -----------------------------------------------------------------
    def pool(
        self,
        space: Space,
        fixed: dict[str, Any],
        rules: Iterable[Callable[[dict[str, Any]], str | None]] = (),
    ) -> list[tuple[float, dict[str, Any]]]:
        """Every valid candidate of the space's grid with its speed prior, fastest first.

        Computed once per search (the space, the pins and the rules do not change): seeding ranks
        from it, and the convergence test walks it from the top."""
        if self._pool is None:
            rules = list(rules)
            scored: dict[str, tuple[float, dict[str, Any]]] = {}
            for cand in space.grid(fixed, float_points=GRID_FLOAT_POINTS):
                cand = space.normalize(constraints.derive(cand, self.recipe))
                key = repr(sorted(cand.items()))
                if key in scored or constraints.violations(cand, self.recipe, rules):
                    continue
                scored[key] = (self.prior(cand), cand)
            # the prior's ties go to each integer knob's larger value (a batch, a TP degree: what a
            # step gets its work done with), not to the order a space lists them in, which decided
            # where verl's search started (docs/benchmarks-notes.md, forty-fourth pass)
            self._pool = sorted(scored.values(), key=lambda t: (-t[0], larger_first(t[1], space.params)))
        return self._pool

    def sizes(self, pool: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, bool]]:
        """(uncalibrated GiB, whether vLLM cannot start) of each candidate of ``pool`` (the one
        :meth:`pool` returns), computed once: the start-up check and the seeds both walk the whole
        grid (48,720 candidates for a 7B on 4 GPUs), and estimating it twice took a fifth of a
        simulated search's time."""
        return self._grid(pool)[1]

    def plausible_in(self, pool: list[tuple[float, dict[str, Any]]]) -> list[bool]:
        """:meth:`plausible` of each candidate of ``pool`` at once (up to rounding), from its parts
        estimated once (calibration changes only their weights): the grid's best open candidate is
        looked for among the plausible ones, which on a tight card sit thousands deep in the prior's
        order."""
        if not (self.use_model and self.weights):
            return [True] * len(pool)
        import numpy as np

        parts = self._grid(pool)[2]
        gib = parts @ np.array([self.weights.get(k, 1.0) for k in CALIBRATED_PARTS] + [1.0])
        return (gib <= (headroom_limit(self.recipe) or math.inf)).tolist()

    def _grid(self, pool: list[tuple[float, dict[str, Any]]]) -> tuple[Any, list[tuple[float, bool]], Any]:
        """The key the grid was estimated for, its :meth:`sizes`, and its parts (a row per candidate:
        the calibrated parts, then whatever else an estimate holds, which calibration does not
        weigh: none today), estimated once per pool, recipe and model."""
        owners = (pool, self.recipe, self.model)
        held = self._estimated
        if held is None or any(a is not b for a, b in zip(held[0], owners)):
            import numpy as np

            estimates = [self.raw(c) for _, c in pool]
            sizes = [(est.total_gib, bool(est.vllm_problem)) for est in estimates]
            parts = np.array(
                [
                    [est.features.get(k, 0.0) for k in CALIBRATED_PARTS]
                    + [sum(v for k, v in est.features.items() if k not in CALIBRATED_PARTS)]
                    for est in estimates
                ]
            ).reshape(len(estimates), len(CALIBRATED_PARTS) + 1)
            self._estimated = (owners, sizes, parts)
        return self._estimated
