"""The search loop: ask the policy, gate the candidate, execute it, tell the study.

One iteration asks Optuna (whose sampler is the :class:`PolicySampler`) for a candidate, fills the
derived and pinned values, and gates it: what the rules forbid is recorded as invalid, what was
already measured is answered from the study, and what the planner knows cannot fit is skipped.
Everything else runs as one trial until its throughput is measured, and is told to the study and
the planner. The iterations are driven by :class:`Scheduler` (search/parallel.py), which keeps one
trial per GPU slot running and tells outcomes as they arrive; with one slot it is the plain loop.
At the end the leaders are confirmed by longer runs, once per study under a lock held in the
storage, before anything is exported. Everything ``resume``, ``show`` and ``export`` need is in
the study storage and the trial folders.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.errors import UsageError
from autotune.export import export_study
from autotune.export.report import REPORT_EVERY_S, write_report
from autotune.hardware import plan_slots
from autotune.progress import Reporter, short_params
from autotune.recipe import Recipe
from autotune.runners import Runner, TrialContext, make_runner
from autotune.search import candidates, coverage
from autotune.search.confirm import confirm, search_on, searching_on
from autotune.search.headroom import incumbent, save_risks
from autotune.search.knobs import KnobMemory
from autotune.search.momentum import flat_knobs
from autotune.search.parallel import Scheduler, answered  # noqa: F401  (answered: tests import it from here)
from autotune.search.planner import Planner
from autotune.search.policy import PolicySampler, make_tpe, tried
from autotune.search.prior_check import blind_knobs, local_optimum, neighbourhood_measured, prior_agrees
from autotune.search.pruning import BelowBestPruner
from autotune.search.state import Finished, Previous, SearchState
from autotune.search.stopping import Budget, Stopping
from autotune.search.transient import Reruns
from autotune.search.walk import Walk
from autotune.study import (
    StudyPaths,
    candidate_key,
    choose_best,
    confirmations,
    launched_rows,
    measured_configs,
    open_study,
    record,
    recover_interrupted,
    rows,
)
from autotune.study.incidents import long_run_failures
from autotune.study.lock import StudyLock
from autotune.study.ranking import Confirmation, noise, step_noise
from autotune.trial.control import StopRule, TrialControl
from autotune.trial.outcome import Outcome, Status

log = logging.getLogger(__name__)

IMPOSSIBLE_FACTOR = 1.5  # refuse to start when even the leanest candidate is predicted above this x capacity
MIN_LAUNCHED = 6  # trials before the search may stop as converged (seeds plus a few local moves)
REPEAT_OF = "repeat_of"  # Outcome.extra of a repeat: the trial that answered it (it gets no folder)
PATIENCE = 8  # launched trials without a gain beyond the noise before converging is considered

# An executor runs one candidate and says what happened. The default is the runner's real process;
# the benchmark swaps in the simulator's ground truth, in-process.
Executor = Callable[[dict[str, Any], Path, int, TrialControl], Outcome]


@dataclass
class SearchResult:
    launched: int
    best: Any | None
    stopped_reason: str | None = None
    exported: list[Path] = field(default_factory=list)
    confirmed: int = 0
    confirmation: Confirmation | None = None  # the winner's confirmation run, if it had one


def fixed_values(space: Space, recipe: Recipe, runner: Runner) -> dict[str, Any]:
    """Values the sampler must not touch: pins, derived accumulation, knobs the runner cannot set."""
    fixed = {**{k: v for k, v in runner.forced().items() if k not in recipe.pins}, **recipe.pins}
    searched = runner.searched()
    if searched is not None:
        for name, param in space.params.items():
            if name not in searched and name not in fixed:
                fixed[name] = param.default
    accumulation = space.batch.accumulation if space.batch is not None else "gradient_accumulation_steps"
    if recipe.global_batch and accumulation is not None:
        fixed[accumulation] = 0  # placeholder, replaced by constraints.derive
    return fixed


class Search:
    """Runs one study until its trial count, its time budget or a stop condition."""

    def __init__(
        self,
        recipe: Recipe,
        paths: StudyPaths,
        context: TrialContext,
        reporter: Reporter,
        execute: Executor | None = None,
        storage: Any = None,
        use_planner: bool = True,
        report: bool = True,
        slots: list[list[int] | None] | None = None,
    ):
        self.recipe, self.paths, self.reporter, self.storage = recipe, paths, reporter, storage
        self.report = report  # keep runs/<study>/report.html current (off in the benchmark)
        self.space = context.space
        self.runner = make_runner(context)
        self.rules = self.runner.rules()
        self.fixed = fixed_values(self.space, recipe, self.runner)
        constraints.check_pins_leave_candidates(self.space, recipe, self.fixed, self.rules)
        self.valid, _ = constraints.valid_combinations(self.space, recipe, self.fixed, self.rules)
        forced = constraints.forced_values(self.space, self.valid)
        if forced:
            log.info("fixed by the rules (only one valid value): %s", forced)
            self.fixed.update(forced)
            self.valid, _ = constraints.valid_combinations(self.space, recipe, self.fixed, self.rules)
        self.execute: Executor = execute or self.runner.run
        known = {"use_model": recipe.device != "cpu", "knobs": KnobMemory.of(self.space)}
        self.planner = Planner(context.model, recipe, context.gpu, **known) if use_planner else None
        self.check_something_fits()
        # the GPU sets trials run on at once (one per slot); checked here, before anything is written
        self.slots = slots or plan_slots(
            recipe.gpus,
            recipe.parallel,
            recipe.node_gpus,
            need_visible=recipe.device == "cuda" and recipe.runner != "sim",
        )
        self._state: SearchState | None = None  # made by open(), when the study is

    @property
    def state(self) -> SearchState:
        if self._state is None:
            raise RuntimeError("the search has no state before open()")
        return self._state

    @property
    def stopping(self) -> Stopping:
        return self.state.stopping

    def run(self) -> SearchResult:
        state = self.open()
        study = state.study
        confirmed, went_on = 0, ""
        for again in (False, True):  # again only where its bar cannot be exported (searching_on)
            stopped_reason = Scheduler(state, self, self.slots).run()  # ask, gate, execute, tell
            launched = len(launched_rows(study))
            if stopped_reason is None:
                stopped_reason = f"stopped after {launched} trials: the --trials limit"
            with StudyLock(study._storage, study.study_name, "finish"):  # noqa: SLF001  once, across nodes
                recover_interrupted(study, self.paths, sweep=True)
                confirmed += confirm(state, self.execute, self.slots)
                bar = None if again else searching_on(state, stopped_reason)
                if bar is None:
                    stopped_reason += went_on
                    study.set_user_attr("stopped", stopped_reason)
                    study.set_user_attr("elapsed_s", round(state.stopping.budget.elapsed(), 1))
                    exported = export_study(study, self.recipe, self.paths.best, withdraw=True)
                    self.refresh_report(study)
                    break
            went_on = search_on(state, bar)
        done = confirmations(study)
        best, _ = choose_best(rows(study), self.recipe, done, long_run_failures(study))
        return SearchResult(
            launched=launched,
            best=best,
            stopped_reason=stopped_reason,
            exported=exported,
            confirmed=confirmed,
            confirmation=done.get(best.number) if best else None,
        )

    def refresh_report(self, study: optuna.Study, every_s: float = 0.0) -> None:
        """Rewrite report.html (at most every ``every_s`` seconds); a report that cannot be written
        never stops the search."""
        if not self.report:
            return
        try:
            write_report(study, self.recipe, self.paths, every_s=every_s)
        except OSError as exc:
            log.warning("report.html not written: %s", exc)

    def check_something_fits(self) -> None:
        """Refuse pins or a space under which even the leanest candidate is far too big.

        Only far (:data:`IMPOSSIBLE_FACTOR` x capacity), since the model is uncalibrated here, and
        only for trainers whose memory it describes (autotune's TRL worker, the simulator): a
        ``--command`` trainer may quantize or shard in ways the model does not know, so it gets a
        warning instead of a refusal."""
        if self.planner is None or not self.planner.use_model:
            return
        lean = candidates.leanest(self.planner, self.planner.pool(self.space, self.fixed, self.rules))
        cap = self.recipe.gpu_memory_gib
        if lean is None or lean[1].total_gib <= cap * IMPOSSIBLE_FACTOR:
            return
        params, est = lean
        parts = {
            "model states": est.model_states_gib,
            "activations": est.activations_gib,
            "logits": est.logits_gib,
            "reference model": est.reference_gib,
            "vLLM": est.vllm_gib,
        }
        part, size = max(parts.items(), key=lambda kv: kv[1])
        pinned = ", ".join(f"{k}={v}" for k, v in self.recipe.pins.items()) or "the space as it is"
        message = (
            f"nothing can fit with {pinned}: the leanest candidate ({short_params(params)}) needs "
            f"{est.total_gib:.0f} GiB per GPU of {cap:.0f}, {part} alone {size:.0f} GiB; pin less (allow "
            "ZeRO-3 and offload), shorten the sequences, or use more or larger GPUs"
        )
        if self.recipe.runner in ("trl", "sim"):
            raise UsageError(message)
        log.warning(
            "%s (searching anyway: the --command trainer may use less than the model predicts)", message
        )

    def converged(self, launched: int) -> str | None:
        """Why to stop as converged, or None: not while a value is unsettled (search/coverage.py);
        while it is, and in the last launches of --trials, the walk raises vLLM's share."""
        reason = self._converged(launched)
        args = (self.planner, self.state.study, self.recipe, self.space, self.fixed, self.rules)
        ending = reason is not None or coverage.closing(self.state.study, self.recipe.trials)
        unsettled = ending and self.planner is not None and coverage.unsettled(*args)
        self.state.study.sampler.settling = unsettled
        return None if unsettled else reason

    def _converged(self, launched: int) -> str | None:
        """Why to stop now that nothing untried is likely to beat the incumbent, or None.

        Always: ``--patience`` trials that ran (an OOM says nothing of speed and costs a fraction
        of a trial) without a gain beyond the noise, after at least :data:`MIN_LAUNCHED` + patience
        launched trials (docs/benchmarks-notes.md: what trials 20-30 bought on the benchmark).

        Earlier, only with a usable memory model and speed prior (GPU trials), after
        :data:`MIN_LAUNCHED` trials, a measured success and :data:`PATIENCE` launched trials without
        a gain beyond the noise: when every near neighbour of the best was measured or ruled out, or
        when the planner walks the candidates by prior and finds none whose expected
        throughput, raised by how far measurements strayed from the prior, beats the best by more
        than the measurement noise. (Patience 8 with half a standard deviation was chosen on the
        benchmark over patience 6 with one: see docs/benchmarks-notes.md.)"""
        state = self.state
        patience = self.recipe.patience
        if (
            patience
            and state.best_value
            and launched >= MIN_LAUNCHED + patience
            and state.measured_since_gain >= patience
        ):
            return (
                f"stopped after {launched} trials: converged, the last {state.measured_since_gain} "
                f"that ran brought no gain beyond the noise over the best {state.best_value:.3g} "
                f"completions/s (--patience {patience})"
            )
        if (
            self.planner is None
            or not self.planner.use_model
            or launched < MIN_LAUNCHED
            or not state.best_value
        ):
            return None
        spread = noise(rows(state.study), confirmations(state.study))
        if launched - state.improved_at < PATIENCE:
            return None
        pool = self.planner.pool(self.space, self.fixed, self.rules)
        done = set(measured_configs(state.study))
        walk = Walk.of(self.planner, self.space, self.fixed, self.rules, done, candidate_key)
        flat = flat_knobs(self.planner, walk.names, spread)
        if local_optimum(walk, flat):
            return (
                f"stopped after {launched} trials: converged, every neighbour of the best "
                f"{state.best_value:.3g} completions/s was measured or ruled out, and "
                f"{launched - state.improved_at} trials brought no gain beyond the noise ({spread:.0%})"
            )
        if self.planner.improvable(pool, done, candidate_key, state.best_value, spread):
            return None
        if not prior_agrees(self.planner, spread) and not neighbourhood_measured(walk):
            return None  # an unchecked prior's "nothing better" is no reason to stop
        best = incumbent(self.planner)
        if best is None:
            return None
        blind = blind_knobs(self.planner, self.space, self.fixed, best.params) - flat
        if blind and not local_optimum(walk, flat, blind):
            return None  # the prior cannot see these knobs: its "nothing better" says nothing of them
        return (
            f"stopped after {launched} trials: converged, no untried candidate is expected to beat "
            f"the best {state.best_value:.3g} completions/s by more than the noise ({spread:.0%})"
        )

    def open(self) -> SearchState:
        """Open the study, recover what a killed controller left, and learn from its trials."""
        study = open_study(self.paths, self.recipe, pruner=BelowBestPruner(), storage=self.storage)
        study.sampler = PolicySampler(
            make_tpe(self.recipe, salt=len(study.trials)),
            space=self.space,
            recipe=self.recipe,
            fixed=self.fixed,
            rules=self.rules,
            valid=self.valid,
            planner=self.planner,
        )
        recover_interrupted(study, self.paths)
        previous = launched_rows(study)
        stopping = Stopping(
            Budget(
                self.recipe.time_budget_s,
                float(study.user_attrs.get("elapsed_s", 0.0)),
                [t.user_attrs.get("wall_time_s") or 0 for t in previous],
            ),
            self.paths.name,
        )
        if self.planner is not None:
            planner, pool = self.planner, self.planner.pool(self.space, self.fixed, self.rules)
            stopping.exhausted = lambda: candidates.exhausted(planner, pool, tried(study), candidate_key)
        self.reruns = Reruns()  # transient crashes waiting for their one re-run
        state = SearchState(
            self.recipe, self.paths, self.space, self.fixed, self.reporter, self.planner, study, stopping
        )
        state.relearn()  # its trials, confirmations that died and a production run's OOMs
        state.rebar()  # a resumed search waits its patience again, from what it can export
        self._state = state
        return state

    def gate(
        self, number: int, params: dict[str, Any], previous: Previous | None
    ) -> tuple[Outcome | None, float | None]:
        """The outcome of a candidate that needs no launch (invalid, a repeat, skipped), or None
        to launch it, with the planner's predicted peak."""
        broken = constraints.violations(params, self.recipe, self.rules)
        if broken:
            self.reporter.not_launched(number, params, "invalid", broken[0])
            return Outcome(status=Status.INVALID, detail="; ".join(broken)), None
        if previous is not None:
            first, prev = previous
            return Outcome(
                status=prev["status"],
                oom_kind=prev.get("oom_kind"),
                throughput=prev.get("throughput"),
                peak_memory_gib=prev.get("peak_memory_gib"),
                error_line=prev.get("error_line"),
                detail=f"same configuration as trial {first}; not run again",
                pruned=bool(prev.get("pruned")),
                extra={REPEAT_OF: first},
            ), None
        verdict = self.planner.verdict(params) if self.planner else None
        if verdict is not None and verdict.skip:
            self.reporter.not_launched(number, params, "skipped", verdict.reason or "")
            return Outcome(
                status=Status.SKIPPED, detail=verdict.reason, predicted_gib=verdict.predicted_gib
            ), None
        return None, verdict.predicted_gib if verdict is not None else None

    def measure(
        self, trial: optuna.Trial, params: dict[str, Any], launched: int, predicted_gib: float | None
    ) -> Outcome:
        """Run one candidate as a trial, reported live, until its throughput is measured."""
        self.state.stopping.launched()
        self.reporter.trial_started(trial.number, launched, params)
        control = TrialControl(
            StopRule.searching(self.recipe),
            trial,
            constraints.samples_per_step(params, self.recipe, self.space),
            on_step=lambda rec, n=trial.number: self.reporter.step(n, rec),
            step_noise=step_noise(rows(self.state.study)),
        )
        outcome = self.execute(params, self.paths.trial_dir(trial.number), trial.number, control)
        outcome.launched = True
        outcome.extra["step_pair"] = control.first_pair  # as trial.execute keeps it, for any executor
        if predicted_gib is not None:
            outcome.predicted_gib = round(predicted_gib, 3)
        return outcome

    def tell(self, trial: optuna.Trial, params: dict[str, Any], key: str, outcome: Outcome) -> None:
        """Record the outcome; a launched one is also learned from (:meth:`SearchState.observe`),
        and a new best is exported at once."""
        state = self.state
        trial_dir = self.paths.trial_dir(trial.number)
        record(
            state.study,
            trial,
            params,
            outcome,
            launched=outcome.launched,
            key=key,
            trial_dir=None if REPEAT_OF in outcome.extra else trial_dir,  # a repeat has its answer's
            memory_limit_gib=self.memory_limit(),
        )
        if not outcome.launched:
            state.stopping.not_launched()
            return
        state.study.set_user_attr("elapsed_s", round(state.stopping.budget.elapsed(), 1))
        new_best = state.observe(Finished.of_outcome(trial.number, params, outcome, launched=True))
        save_risks(state.study, self.planner)
        self.reporter.trial_finished(trial.number, outcome)
        fine = [s.params for s in self.planner.seen if s.status == Status.OK] if self.planner else []
        again = self.reruns.after(state.study, trial.number, key, params, outcome, fine)
        if again:
            self.reporter.message(again)
        self.refresh_report(state.study, every_s=REPORT_EVERY_S)
        if new_best:
            export_study(state.study, self.recipe, self.paths.best)
        state.stopping.finished(outcome, trial_dir)

    def memory_limit(self) -> float | None:
        """Peak memory an exportable config may reach: headroom below the GPU's memory, or on CPU
        below ``--memory-limit`` (None on CPU without one: the host's RAM is not the limit)."""
        from autotune.study.ranking import headroom_limit

        return headroom_limit(self.recipe)
