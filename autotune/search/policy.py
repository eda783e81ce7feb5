"""The proposal policy, as an Optuna sampler: which candidate to measure next.

GRPO's fastest configurations sit near the memory boundary of a flat-topped landscape, and most of
a tight space does not fit, so plain TPE wastes its first trials. :class:`PolicySampler` wraps TPE
the way Optuna's own samplers wrap one another, and before each trial decides whether to hand the
trial a candidate of its own (Optuna's ``fixed_params``, what ``enqueue_trial`` uses) or to let TPE
sample it:

1. **Seeds**: the candidates the memory model expects to fit and the speed prior ranks fastest,
   spread over ZeRO stages and the values of knobs of unknown memory effect, the prior's ties going
   to each integer knob's larger value (:mod:`autotune.search.seeds`,
   :func:`autotune.search.planner.larger_first`); without a usable model (CPU trials), hand-written
   starting points that find the memory boundary at once.
2. **Local search**: two proposals in three, the most promising untried neighbour of the best trial so
   far (:meth:`Planner.next_local`, where a peak was measured a tie the prior cannot read going to the
   step that spends memory, and what still ties up an integer knob of unknown effect on memory, a TP
   degree: :meth:`autotune.search.knobs.KnobMemory.rises`; going on along a knob while it pays, the
   value between when a step that paid peaked inside the headroom, and, when the micro-batch cannot go
   up by itself, a memory saver traded for a larger one, or a knob of unknown effect on memory
   measured to cost speed asked whether it is one: :mod:`autotune.search.trade`); the one-knob steps
   leave in turn from the incumbent and from runners-up a second run could rank above it (within twice
   the noise, elsewhere in the space: :func:`co_leaders`); while nothing has fit, a step from every
   OOM along its kind's cure, or after three CUDA OOMs the leanest open candidate
   (:mod:`autotune.search.cures`).
3. **The best open candidate of the grid** every third proposal (fewer while its trials run out of
   memory: :func:`pool_pays`), and after three proposals in a row that needed no launch (invalid, a
   repeat, skipped): the proposers can circle forever around what is ruled out while candidates no
   failure dominates are left. Best expected among the first by prior that the model, once a
   measured peak calibrates it, puts inside the headroom, or among the first by prior when none
   open is (:mod:`autotune.search.candidates`); without a planner or an open candidate, a random
   valid one.
4. Otherwise **TPE** (multivariate, reading each trial's ``fits`` constraint).

A trial that already carries ``fixed_params`` (an interrupted trial queued again on resume) is
left alone. The seeds are computed once per study and kept in its user attributes, so a resumed
search continues the same list.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState

from autotune.candidate import constraints
from autotune.candidate.moves import knobs_apart
from autotune.candidate.space import Space
from autotune.recipe import Recipe
from autotune.search import candidates, coverage, cures
from autotune.search.headroom import exportable
from autotune.search.momentum import between, flat_knobs, keep_going, promising_onward
from autotune.search.planner import Planner, Seen
from autotune.search.seeds import seed_candidates
from autotune.search.state import tried, walk_from
from autotune.search.trade import next_trade, saver_experiment
from autotune.search.walk import Walk
from autotune.study import candidate_key, confirmations, rows
from autotune.study.claims import pending_keys
from autotune.study.ranking import noise
from autotune.study.recovery import claim_owner
from autotune.trial.outcome import UNINFORMATIVE, Status

PROPOSAL_ATTR = "autotune:proposal"  # trial system attribute: seed | local | pool | valid
SEEDS_ATTR = "seeds"  # study user attribute: the seed candidates, in order
LOCAL_EVERY = 3  # of every three proposals, two are local (after the seeds)
STALL_STREAK = 3  # proposals in a row that needed no launch before the grid's best open candidate
POOL_BACKOFF = 3  # halvings of the pool's turns after its proposals ran out of memory in a row
CO_LEADERS = 3  # the incumbent and up to two runners-up within the noise take the one-knob steps in turn

Rules = Sequence[Callable[[dict[str, Any]], "str | None"]]


def make_tpe(recipe: Recipe, salt: int = 0) -> TPESampler:
    """TPE; it reads each trial's constraint (``Trial.set_constraint``) and ranks infeasible
    trials below feasible ones. Few random start-up trials: seeds come first. ``salt`` keeps a
    resumed study from replaying the random start-up proposals of the first session."""
    return TPESampler(
        seed=recipe.seed + salt, n_startup_trials=8, multivariate=True, group=False, constant_liar=True
    )


class PolicySampler(BaseSampler):
    """Seeds, local search around the incumbent and a random valid fallback, over TPE."""

    def __init__(
        self,
        tpe: BaseSampler,
        *,
        space: Space,
        recipe: Recipe,
        fixed: dict[str, Any],
        rules: Rules,
        valid: list[dict[str, Any]],
        planner: Planner | None,
    ) -> None:
        self._tpe = tpe
        self.space, self.recipe, self.fixed, self.rules = space, recipe, fixed, list(rules)
        self.valid = valid
        self.planner = planner
        self.rng = random.Random(recipe.seed)
        self.asked = 0  # proposals in this session: the local-search rhythm counts them
        self.stall = 0  # proposals in a row that needed no launch (invalid, a repeat, skipped)
        self.local_turns = 0  # one-knob steps proposed: they take the co-leaders in turn
        self.settling = False  # the search would stop as converged, or ends, with a value still open

    # -- Optuna's sampler interface: TPE does the sampling --------------------------------------
    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self._tpe.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return self._tpe.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._tpe.sample_independent(study, trial, param_name, param_distribution)

    def reseed_rng(self) -> None:
        self._tpe.reseed_rng()

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Decide this trial's candidate, if the policy has one, before any parameter is sampled.

        First of all the trial is marked as this controller's, so that another controller sharing
        the study does not take it for a dead one's while the policy thinks."""
        claim_owner(study, trial)
        self._tpe.before_trial(study, trial)
        proposal = self.propose(study, trial)
        if proposal is None:
            return
        kind, params = proposal
        fixed = {k: v for k, v in params.items() if k in self.space.params and k not in self.fixed}
        trial.system_attrs["fixed_params"] = fixed  # optuna.Trial reads it right after this call
        study._storage.set_trial_system_attr(trial._trial_id, "fixed_params", fixed)  # noqa: SLF001
        study._storage.set_trial_system_attr(trial._trial_id, PROPOSAL_ATTR, kind)  # noqa: SLF001

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self.stall = 0 if trial.user_attrs.get("launched") else self.stall + 1
        self._tpe.after_trial(study, trial, state, values)

    # -- the policy -----------------------------------------------------------------------------
    def propose(self, study: optuna.Study, trial: FrozenTrial) -> tuple[str, dict[str, Any]] | None:
        """('seed' | 'local' | 'pool' | 'valid', candidate), or None to let TPE sample this trial."""
        turn = self.asked
        self.asked += 1
        if trial.system_attrs.get("fixed_params"):
            return None  # queued again after an interruption: run it as it was
        seed = self.next_seed(study)
        if seed is not None:
            return "seed", seed
        due = turn % LOCAL_EVERY == 0
        stalled = self.stall >= STALL_STREAK
        pool_turn = due and (self.planner is None or stalled or pool_pays(study, trial.number))
        local = self.local(study) if not pool_turn else None
        if local is not None:
            return "local", local
        if stalled or (due and self.planner is not None):
            if self.planner is not None:
                pool = self.planner.pool(self.space, self.fixed, self.rules)
                cand = candidates.next_open(self.planner, pool, tried(study), candidate_key)
                if cand is not None:
                    return "pool", cand
            valid = self.random_valid(study)
            if valid is not None:
                return "valid", valid
        return None

    def next_seed(self, study: optuna.Study) -> dict[str, Any] | None:
        if SEEDS_ATTR not in study.user_attrs:
            if study.user_attrs.get("seeded"):  # a study from before seeds were kept: nothing left
                return None
            study.set_user_attr(
                SEEDS_ATTR, seed_candidates(self.planner, self.space, self.recipe, self.fixed, self.rules)
            )
        used = sum(1 for t in study.get_trials(deepcopy=False) if t.system_attrs.get(PROPOSAL_ATTR) == "seed")
        seeds = study.user_attrs[SEEDS_ATTR]
        return seeds[used] if used < len(seeds) else None

    def local(self, study: optuna.Study) -> dict[str, Any] | None:
        """The most promising untried neighbour of the best trial so far."""
        if self.planner is None:
            return None
        walk = Walk.of(self.planner, self.space, self.fixed, self.rules, tried(study), candidate_key)
        best = walk_from(study, self.recipe)
        if best is None:  # nothing fits yet: walk from the nearest OOM
            return cures.toward_feasible(walk)
        incumbent = next((s for s in self.planner.seen if s.number == best.number), None)
        if incumbent is not None:  # along the knob that made the incumbent, while it pays
            onward = keep_going(walk, incumbent)
            if onward is not None:
                return onward
        table = rows(study)  # read once: the coverage and the noise below both read it
        ran = coverage.launched(table)
        unread = coverage.open_value(walk, best.params, ran)
        if unread is not None:  # a switch nothing describes, at a value not yet settled
            return unread
        if self.settling:  # the search would stop or ends: vLLM's share, up while the peak has room
            if (share := coverage.larger_share(walk, best.params, ran, pending_keys(study))) is not None:
                self.settling = False  # one raise for each stop held back (converged asks again)
                return share
        further = promising_onward(walk, best.throughput or 0.0)
        if further is not None:  # a runner-up whose paying knob, followed, would beat the best
            return further
        inside = between(walk, best.throughput or 0.0)
        if inside is not None:  # a step that paid peaked inside the headroom: the value between
            return inside
        traded = next_trade(walk, best.params)
        if traded is not None:  # the micro-batch is stuck: a memory saver on, and what it frees spent
            return traded
        spread = noise(table, confirmations(study))
        asked = saver_experiment(walk, best.params, spread)
        if asked is not None:  # ... and a knob nobody knows the memory of may be the saver
            return asked
        flat = flat_knobs(self.planner, walk.names)
        self.local_turns += 1
        leaders = co_leaders(self.planner, best.number, spread)
        for center in rotate([s.params for s in leaders], self.local_turns) or [best.params]:
            step = self.planner.next_local(
                center, self.space, self.fixed, self.rules, walk.tried, candidate_key, flat
            )
            if step is not None:
                return step
        return None

    def random_valid(self, study: optuna.Study) -> dict[str, Any] | None:
        """A random untried candidate that passes the rules."""
        tried_ = tried(study)
        for _ in range(50):
            combo = self.rng.choice(self.valid)
            values = {
                name: self.rng.choice(param.grid_values(15)) for name, param in self.space.params.items()
            }
            cand = self.space.normalize(constraints.derive({**values, **self.fixed, **combo}, self.recipe))
            if candidate_key(cand) not in tried_ and not constraints.violations(
                cand, self.recipe, self.rules
            ):
                return cand
        return None


def co_leaders(planner: Planner, best: int, spread: float) -> list[Seen]:
    """The incumbent and the measured successes a second run could rank above it: within twice the
    noise of its throughput (two runs of one configuration differ that much), keeping the headroom,
    in another region (two knobs or more away). With 8% step-time noise a micro-batch-8 configuration
    at 0.99 of the best possible measured 3.52/s against a lucky micro-batch-1 incumbent's 3.69/s, and
    the one-knob walk never left the incumbent's corner (VL 3B #33: 0.84)."""
    ok = exportable(planner)
    top = next((s for s in ok if s.number == best), None)
    if top is None:
        return []
    bar = (top.throughput or 0.0) / (1 + 2 * spread)
    others = sorted(
        (
            s
            for s in ok
            if s is not top and (s.throughput or 0.0) >= bar and knobs_apart(s.params, top.params) >= 2
        ),
        key=lambda s: -(s.throughput or 0.0),
    )
    return [top, *others[: CO_LEADERS - 1]]


def rotate(items: list[Any], turn: int) -> list[Any]:
    """``items`` starting at ``turn`` (mod its length): each turn a different one goes first."""
    if not items:
        return items
    i = turn % len(items)
    return items[i:] + items[:i]


def pool_pays(study: optuna.Study, asking: int) -> bool:
    """Whether the grid's best open candidate takes its turn (every :data:`LOCAL_EVERY` proposals):
    always while the last of its trials that answered did not run out of memory; after k such OOMs
    in a row, once every 2**k turns (at most :data:`POOL_BACKOFF` halvings), the walk taking the
    others. Where the memory model cannot read a trainer's knobs, the pool ranks by the speed prior
    alone, which puts the largest micro-batch with one more saver first, and OOMs it over and over (a
    NeMo-RL-style trainer: all ten pool trials of some searches, eight in an average one). A trial
    still running, decided without a launch, or ended by a crash or an interruption says nothing of
    memory and neither ends nor lengthens the streak; every trial asked since the pool's last one
    (``asking``, the one being decided now, apart) is a turn gone by."""
    trials = study.get_trials(deepcopy=False)
    pool = [t for t in trials if t.system_attrs.get(PROPOSAL_ATTR) == "pool"]
    misses = 0
    for t in reversed(pool):
        status = t.user_attrs.get("status")
        if not t.user_attrs.get("launched") or status is None or status in UNINFORMATIVE:
            continue
        if status != Status.OOM:
            break
        misses += 1
    if misses == 0:
        return True
    last = pool[-1].number
    since = sum(1 for t in trials if t.number > last and t.number != asking and t.state != TrialState.WAITING)
    return since >= LOCAL_EVERY * 2 ** min(misses, POOL_BACKOFF) - 1
