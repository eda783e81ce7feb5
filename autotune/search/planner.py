"""The planner sits between the sampler and the launcher: feasible? predicted peak? worth running?

It combines three kinds of knowledge, cheapest first:
1. what trials have shown: a candidate that needs at least as much memory as a measured OOM in
   every memory-raising knob will OOM too (skip it); one that needs no more than a measured success
   fits (never skip it on the model's word);
2. the memory model (``autotune.search.memory``), calibrated by per-part corrections fitted to every measured
   peak, so its error shrinks as the night goes on (OOMs teach through dominance, above);
3. a speed prior (``autotune.speed``) to rank the candidates the model expects to fit, so the
   first trials of a study are already good ones.
Skipped candidates cost no GPU time and are told to Optuna as infeasible, like OOMs.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from autotune.search import constraints
from autotune.hardware import GpuType
from autotune.search.memory import Estimate, estimate
from autotune.models import ModelSpec
from autotune.recipe import Recipe
from autotune.search.space import Space
from autotune.search.speed import throughput_prior

log = logging.getLogger(__name__)

OFFLOAD_RANK = {"none": 2, "optimizer": 1, "optimizer+params": 0}   # higher = more GPU memory


def memory_vector(params: dict[str, Any]) -> tuple[float, ...]:
    """Each knob oriented so that larger means more GPU memory (num_generations and accumulation
    do not change the per-GPU peak: TRL's micro-batch counts completions)."""
    colocated = bool(params.get("use_vllm")) and params.get("vllm_mode", "colocate") == "colocate"
    return (
        float(params.get("per_device_train_batch_size", 8)),
        -float(params.get("zero_stage", 0)),
        float(OFFLOAD_RANK.get(params.get("offload", "none"), 2)),
        0.0 if params.get("gradient_checkpointing", True) else 1.0,
        1.0 if colocated else 0.0,
        float(params.get("vllm_gpu_memory_utilization", 0.0)) if colocated else 0.0,
        0.0 if (colocated and params.get("vllm_enable_sleep_mode")) else 1.0,
        -float(params.get("vllm_tensor_parallel_size", 1)) if colocated else 0.0,
    )


def _distance(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    import math

    return sum(abs(math.log2(x) - math.log2(y)) if i == 0 and x > 0 and y > 0 else abs(x - y) * (4 if i == 5 else 1)
               for i, (x, y) in enumerate(zip(a, b)))


def at_least(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(x >= y - 1e-9 for x, y in zip(a, b))


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


@dataclass
class Planner:
    """Decides, before launch, whether a candidate is worth a trial."""

    model: ModelSpec
    recipe: Recipe
    gpu: GpuType
    margin: float = 0.10            # skip only when predicted above capacity by this much
    unexplored_margin: float = 0.30  # ... in a ZeRO stage / offload regime not yet measured
    use_model: bool = True          # off for CPU trials (the model describes GPU memory)
    seen: list[Seen] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)   # per-part corrections
    _turn: int = 0                  # which knob the local search moves next
    rel_error: float = 0.25         # typical |measured - predicted| / measured after calibration

    # -- predictions ------------------------------------------------------------------------
    def raw(self, params: dict[str, Any]) -> Estimate:
        r = self.recipe
        return estimate(self.model, params, gpus=r.gpus, capacity_gib=r.gpu_memory_gib,
                        max_prompt_length=r.max_prompt_length,
                        max_completion_length=r.max_completion_length, beta=r.beta,
                        lora_rank=r.lora_rank, dp_gpus=r.dp_gpus(params))

    def predict(self, params: dict[str, Any]) -> float:
        """Calibrated peak GiB per GPU: each part times its learned correction."""
        est = self.raw(params)
        if not self.weights:
            return est.total_gib
        return sum(self.weights.get(k, 1.0) * v for k, v in est.features.items())

    # -- learning ---------------------------------------------------------------------------
    def observe(self, number: int, params: dict[str, Any], status: str, oom_kind: str | None,
                peak_gib: float | None, throughput: float | None = None) -> None:
        self.seen.append(Seen(number, dict(params), status, oom_kind, peak_gib, throughput))
        self.calibrate()

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

        obs = [(self.raw(s.params).features, s.peak_gib) for s in self.seen
               if s.status == "ok" and s.peak_gib]
        if not obs:
            return
        names = ["model_states", "activations", "logits", "vllm", "overhead"]
        X = np.array([[f.get(n, 0.0) for n in names] for f, _ in obs])
        y = np.array([peak for _, peak in obs])
        scale = np.maximum((X ** 2).mean(axis=0), 1e-6)
        lam = 1.0
        A = X.T @ X + lam * np.diag(scale)
        b = X.T @ y + lam * scale
        w = np.clip(np.linalg.solve(A, b), 0.3, 3.0)
        self.weights = dict(zip(names, map(float, w)))
        errors = [abs(self.predict(s.params) - s.peak_gib) / s.peak_gib for s in self.seen
                  if s.status == "ok" and s.peak_gib]
        self.rel_error = float(np.sqrt(np.mean(np.square(errors))))

    @property
    def calibrated(self) -> bool:
        return any(s.status == "ok" and s.peak_gib for s in self.seen)

    # -- decisions --------------------------------------------------------------------------
    def verdict(self, params: dict[str, Any]) -> Verdict:
        vec = memory_vector(params)
        predicted = self.predict(params) if self.use_model else None
        fits_surely = next((s for s in self.seen if s.status == "ok" and at_least(memory_vector(s.params), vec)),
                           None)
        for s in self.seen:
            if s.status != "oom":
                continue
            if self._dominates_oom(params, vec, s):
                return Verdict(True, f"needs at least the memory of trial {s.number}, which hit "
                                     f"oom/{s.oom_kind}", predicted)
        # the model only vetoes once a measured peak has anchored it: an uncalibrated model that
        # is wrong for this trainer (a --command trainer with its own tricks) must not veto
        # every candidate before a single trial has run
        if fits_surely is not None or predicted is None or not self.calibrated:
            return Verdict(False, None, predicted)
        cap = self.recipe.gpu_memory_gib
        margin = max(self.margin, 2 * self.rel_error)
        # extrapolating to a ZeRO stage / offload mode no successful trial has used is where the
        # model is least trustworthy (its model-state term was never measured): be modest there
        regime = (params.get("zero_stage"), params.get("offload"))
        if not any(s.status == "ok" and (s.params.get("zero_stage"), s.params.get("offload")) == regime
                   for s in self.seen):
            margin = max(margin, self.unexplored_margin)
        if predicted > cap * (1 + margin):
            return Verdict(True, f"predicted {predicted:.1f} GiB per GPU > {cap:.1f} GiB capacity "
                                 f"(+{margin:.0%} margin)", predicted)
        return Verdict(False, None, predicted)

    def _dominates_oom(self, params: dict[str, Any], vec: tuple[float, ...], s: Seen) -> bool:
        other = memory_vector(s.params)
        if s.oom_kind == "cuda":
            return at_least(vec, other)
        if s.oom_kind == "vllm_kv":          # vLLM budget too small: smaller or equal fails too
            same = (params.get("vllm_tensor_parallel_size") == s.params.get("vllm_tensor_parallel_size")
                    and params.get("use_vllm") and params.get("vllm_mode", "colocate") == "colocate")
            return bool(same) and float(params.get("vllm_gpu_memory_utilization", 1)) <= float(
                s.params.get("vllm_gpu_memory_utilization", 0)) + 1e-9
        if s.oom_kind == "vllm_startup":     # fraction too large beside the trainer's states
            return (bool(params.get("use_vllm")) and params.get("vllm_mode", "colocate") == "colocate"
                    and float(params.get("vllm_gpu_memory_utilization", 0)) >= float(
                        s.params.get("vllm_gpu_memory_utilization", 1)) - 1e-9
                    and vec[1] >= other[1] and vec[2] >= other[2])
        if s.oom_kind == "host":
            if self.recipe.device == "cpu":  # on CPU trials host RAM is the device memory
                return at_least(vec, other)
            # on GPUs host RAM holds offloaded states: as large a batch with as much offload
            return (params.get("zero_stage") == s.params.get("zero_stage")
                    and vec[0] >= other[0]
                    and OFFLOAD_RANK.get(params.get("offload", "none"), 2)
                    <= OFFLOAD_RANK.get(s.params.get("offload", "none"), 2))
        return False

    def prior(self, params: dict[str, Any]) -> float:
        r = self.recipe
        return throughput_prior(self.model, params, self.gpu, gpus=r.gpus, dp_gpus=r.dp_gpus(params),
                                prompt=r.max_prompt_length, completion=r.max_completion_length, beta=r.beta)

    def next_local(self, incumbent: dict[str, Any], space: Space, fixed: dict[str, Any],
                   rules: Iterable[Callable[[dict[str, Any]], str | None]], tried: set[str],
                   key: Callable[[dict[str, Any]], str]) -> dict[str, Any] | None:
        """The untried neighbour of the incumbent the planner would run, best prior first."""
        options = [c for c in neighbors(incumbent, space, fixed, self.recipe, rules)
                   if key(c) not in tried and not self.verdict(c).skip]
        if not options:
            return None
        # take the knobs in turn, so that a prior that is wrong about one knob (say, the cost of
        # recomputation) cannot keep the search away from that direction for the whole night
        knobs = [n for n in space.params if n not in fixed]
        for _ in range(len(knobs)):
            knob = knobs[self._turn % len(knobs)]
            self._turn += 1
            group = [c for c in options if c.get(knob) != incumbent.get(knob)]
            if group:
                return max(group, key=self.expected_throughput)
        return max(options, key=self.expected_throughput)

    def expected_throughput(self, params: dict[str, Any]) -> float:
        """The speed prior corrected by what was measured nearby: prior x the mean
        measured/prior ratio of the closest successful trials (in knob space)."""
        prior = self.prior(params)
        ok = [(s, s.params) for s in self.seen if s.status == "ok" and s.throughput]
        if not ok:
            return prior
        vec = memory_vector(params)
        nearest = sorted(ok, key=lambda t: _distance(vec, memory_vector(t[1])))[:3]
        ratios = [s.throughput / self.prior(p) for s, p in nearest]
        return prior * statistics.fmean(ratios)

    # -- seeding ----------------------------------------------------------------------------
    def rank_candidates(self, space: Space, fixed: dict[str, Any],
                        rules: Iterable[Callable[[dict[str, Any]], str | None]] = (), k: int = 4,
                        names: list[str] | None = None) -> list[dict[str, Any]]:
        """The k valid candidates the model expects to fit with headroom and the prior ranks
        fastest, spread over ZeRO stages so one wrong guess does not sink all seeds."""
        rules = list(rules)
        limit = self.recipe.gpu_memory_gib * (1 - max(self.recipe.headroom, 0.05) - 0.05)
        scored: list[tuple[float, dict[str, Any]]] = []
        seen_keys: set[str] = set()
        for cand in space.grid(fixed, names=names, float_points=5):
            cand = space.normalize(constraints.derive(cand, self.recipe))
            if constraints.violations(cand, self.recipe, rules):
                continue
            key = repr(sorted(cand.items()))
            if key in seen_keys:
                continue
            seen_keys.add(key)
            if self.use_model:
                est = self.raw(cand)
                if est.vllm_problem or self.predict(cand) > limit:
                    continue
            score = throughput_prior(self.model, cand, self.gpu, gpus=self.recipe.gpus,
                                     dp_gpus=self.recipe.dp_gpus(cand),
                                     prompt=self.recipe.max_prompt_length,
                                     completion=self.recipe.max_completion_length, beta=self.recipe.beta)
            scored.append((score, cand))
        scored.sort(key=lambda t: -t[0])
        picked: list[dict[str, Any]] = []
        stages: set[Any] = set()
        for score, cand in scored:           # best per ZeRO stage first, then the rest by score
            if cand.get("zero_stage") not in stages:
                stages.add(cand.get("zero_stage"))
                picked.append(cand)
            if len(picked) >= k:
                break
        for score, cand in scored:
            if len(picked) >= k:
                break
            if cand not in picked:
                picked.append(cand)
        picked.sort(key=lambda c: -throughput_prior(
            self.model, c, self.gpu, gpus=self.recipe.gpus, dp_gpus=self.recipe.dp_gpus(c),
            prompt=self.recipe.max_prompt_length, completion=self.recipe.max_completion_length,
            beta=self.recipe.beta))
        return picked


def neighbors(params: dict[str, Any], space: Space, fixed: dict[str, Any], recipe: Recipe,
              rules: Iterable[Callable[[dict[str, Any]], str | None]] = ()) -> list[dict[str, Any]]:
    """Valid candidates one or two knobs away from ``params`` (the next choice up or down, a
    flipped switch, the vLLM fraction one or two steps away), for a local search around the
    incumbent. Pairs matter: trading memory between knobs (drop offload, turn on checkpointing)
    is how the fastest configurations are reached from a good one."""
    rules = list(rules)
    full = {**space.defaults(), **params}
    moves = _single_moves(full, space, fixed)
    out: list[dict[str, Any]] = []
    combos = [dict([m]) for m in moves]
    combos += [dict([a, b]) for i, a in enumerate(moves) for b in moves[i + 1:] if a[0] != b[0]]
    for change in combos:
        cand = space.normalize(constraints.derive({**full, **change}, recipe))
        if cand != space.normalize(full) and not constraints.violations(cand, recipe, rules) and cand not in out:
            out.append(cand)
    return out


def _single_moves(full: dict[str, Any], space: Space, fixed: dict[str, Any]) -> list[tuple[str, Any]]:
    moves: list[tuple[str, Any]] = []
    for name, param in space.params.items():
        if name in fixed or not space.relevant(name, full):
            continue
        value = full[name]
        options: list[Any] = []
        if param.choices is not None:
            choices = list(param.choices)
            if value in choices:
                i = choices.index(value)
                options = [choices[j] for j in (i - 1, i + 1) if 0 <= j < len(choices)]
        elif param.step:
            options = [round(value + d * param.step, 6) for d in (-2, -1, 1, 2)]
            options = [v for v in options if param.contains(v)]
        moves += [(name, option) for option in options]
    return moves
