"""What a running search knows and changes, and the one place a finished trial is learned from.

The search loop (``search/loop.py``), the scheduler that runs its trials (``search/parallel.py``) and
the confirmation runs (``search/confirm.py``) share one :class:`SearchState`, made when the study
is opened. Every finished trial, whoever ran it (this controller, another one sharing the study, a
killed controller whose study is resumed, a confirmation run), goes through
:meth:`SearchState.observe`: the planner's feedback, the best throughput so far and the launch at
which it last improved beyond the noise are kept in step there, not in copies that can drift.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import optuna

from autotune.candidate.space import Space
from autotune.progress import Reporter
from autotune.recipe import Recipe
from autotune.search.headroom import fits_headroom
from autotune.search.planner import Planner
from autotune.search.stopping import Stopping
from autotune.study import StudyPaths, TrialRow, eligible, launched_rows, measured_configs, rows
from autotune.study.claims import pending_keys
from autotune.study.incidents import incidents, long_run_failures
from autotune.study.ranking import MIN_NOISE, confirmations, headroom_limit
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import STATUSES, UNINFORMATIVE, Outcome, Status, read_outcome

#: How an answered configuration is remembered: the first trial that answered it and its attributes.
Previous = tuple[int, dict[str, Any]]


@dataclass(frozen=True)
class Finished:
    """A finished trial as the search learns from it, from an outcome or from the study's row."""

    number: int
    params: dict[str, Any]
    status: Status
    oom_kind: str | None = None
    peak_memory_gib: float | None = None
    throughput: float | None = None
    pruned: bool = False
    launched: bool = True  # False: answered without a run (a repeat): not taught to the planner
    leftover: bool = False  # started beside a predecessor's memory: its OOM says nothing of itself
    error_line: str | None = None  # a crash's: a value the trainer refused by name is learned

    @classmethod
    def of_outcome(cls, number: int, params: dict[str, Any], outcome: Outcome, *, launched: bool) -> Finished:
        return cls(
            number,
            params,
            outcome.status,
            outcome.oom_kind,
            outcome.peak_memory_gib,
            outcome.throughput,
            outcome.pruned,
            launched,
            bool(outcome.leftover_gib),
            outcome.error_line,
        )

    @classmethod
    def of_row(cls, row: TrialRow, leftover: Callable[[int], bool]) -> Finished:
        """``leftover`` is asked only for an OOM (the only status it changes), as it reads a file."""
        status = Status(row.status)
        return cls(
            row.number,
            row.params,
            status,
            row.oom_kind,
            row.peak_memory_gib,
            row.throughput,
            row.pruned,
            row.launched,
            status == Status.OOM and leftover(row.number),
            row.error_line,
        )


def walk_from(study: optuna.Study, recipe: Recipe) -> TrialRow | None:
    """The trial the local walk steps from: the fastest short trial still exportable. Once
    confirmations ran (a search going on after them, a resumed one), not one whose longer run died
    or peaked inside the headroom, nor one a production run lost: its neighbours share its edge."""
    left, _ = eligible(rows(study), recipe, confirmations(study), failed_long=long_run_failures(study))
    return left[0] if left else None


def tried(study: optuna.Study) -> set[str]:
    """Configurations not to propose again: answered ones, and those running now (in another slot
    or on another node), so K trials asked at once are K different candidates."""
    return set(measured_configs(study)) | set(pending_keys(study))


def short_and_left(study: optuna.Study, recipe: Recipe) -> tuple[list[TrialRow], list[TrialRow]]:
    """The trials exportable by their short trials alone (an unmeasured peak at risk is out), and
    those still exportable once the longer runs (confirmations, production runs) had their say
    (:func:`walk_from`'s list); fastest first."""
    all_rows = rows(study)
    short, _ = eligible(all_rows, recipe)
    left, _ = eligible(all_rows, recipe, confirmations(study), failed_long=long_run_failures(study))
    return short, left


def passed_over(study: optuna.Study, recipe: Recipe) -> set[int]:
    """The trials exportable by their short trial that a longer run took away."""
    short, left = short_and_left(study, recipe)
    return {r.number for r in short} - {r.number for r in left}


@dataclass
class SearchState:
    """One search's state from the moment its study is open: what the scheduler reads and the
    search's steps change. ``best_value`` is the best unpruned throughput seen that keeps the
    headroom free; ``improved_at`` the study's launch count when it last rose by more than the noise
    (convergence waits its patience from there): :data:`MIN_NOISE`, or more where the search's own
    one-knob pairs that the prior cannot tell apart differ by more (``Planner.twin_noise``). Seen: at
    8% run-to-run noise, twins of the best that beat it by 3-6% by luck restarted the patience over
    and over (docs/benchmarks-notes.md, twenty-third pass)."""

    recipe: Recipe
    paths: StudyPaths
    space: Space
    fixed: dict[str, Any]
    reporter: Reporter
    planner: Planner | None
    study: optuna.Study
    stopping: Stopping
    best_value: float = 0.0
    improved_at: int = 0
    measured_since_gain: int = 0  # successes since the last gain (--patience counts these, not OOMs)

    @functools.cached_property
    def searched(self) -> frozenset[str]:
        """The knobs this search varies: not pinned, more than one value."""
        return frozenset(
            name
            for name, param in self.space.params.items()
            if name not in self.fixed and (param.choices is None or len(param.choices) > 1)
        )

    def observe(self, done: Finished) -> bool:
        """Learn from a finished trial; True when it is a new best.

        The planner learns from every launched trial except those that ended for reasons unrelated
        to the configuration (:data:`UNINFORMATIVE`), with a pruned trial's throughput withheld (it
        was stopped before it was measured) and whether a predecessor's memory was still on the GPUs;
        from a crash, only a value its error line names (:mod:`autotune.search.refusals`).
        A gain beyond the noise restarts the convergence patience, whoever measured it."""
        if self.planner is not None and done.launched and done.status not in UNINFORMATIVE:
            self.planner.observe(
                done.number,
                done.params,
                done.status,
                done.oom_kind,
                done.peak_memory_gib,
                None if done.pruned else done.throughput,
                leftover=done.leftover,
            )
        if self.planner is not None and done.launched and done.status == Status.CRASH and not done.leftover:
            self.planner.refusals.learn(done.number, done.params, done.error_line, self.searched)
        value = done.throughput or 0.0
        # a trial that ran inside the headroom is never exported: its gain restarts no patience
        better = (
            done.status == Status.OK
            and not done.pruned
            and value > self.best_value
            and fits_headroom(done.peak_memory_gib, headroom_limit(self.recipe))
        )
        twins = self.planner.twin_noise() if self.planner is not None else 0.0
        gain = better and value > self.best_value * (1 + max(MIN_NOISE, twins))
        if done.launched and done.status == Status.OK:
            self.measured_since_gain = 0 if gain else self.measured_since_gain + 1
        if not better:
            return False
        if gain:
            self.improved_at = len(launched_rows(self.study))
        self.best_value = value
        return True

    def rebar(self) -> float:
        """Count the patience again from the fastest short trial still exportable (:func:`walk_from`;
        returned), with the trials a longer run took away out of the planner's incumbent: a resumed
        search, or one whose bar a longer run then disqualified
        (:func:`autotune.search.confirm.searching_on`), judges what comes next against what can be
        exported."""
        start = walk_from(self.study, self.recipe)
        if self.planner is not None:
            self.planner.passed_over = passed_over(self.study, self.recipe)
        self.best_value = (start.throughput or 0.0) if start else 0.0
        self.improved_at = len(launched_rows(self.study))
        self.measured_since_gain = 0
        return self.best_value

    def leftover(self, number: int) -> bool:
        """Whether trial ``number`` started on GPUs still holding an earlier trial's memory (its
        outcome.json says so; a folder on another node, or none, says no)."""
        done = read_outcome(TrialFiles(self.paths.trial_dir(number)).outcome)  # damaged: one line, says no
        return done is not None and bool(done.leftover_gib)

    def observe_row(self, row: TrialRow) -> bool:
        """:meth:`observe` a trial known only from the study (resumed, or another controller's); one
        told without an outcome (by another program: no status) teaches nothing."""
        if row.status not in STATUSES:
            return False
        return self.observe(Finished.of_row(row, self.leftover))

    def relearn(self) -> None:
        """Learn what an opened study already holds: its trials, the longer confirmation runs that
        ran out of memory and a production run's OOMs (stronger than any short trial). A resumed
        study that forgot a leader's dead confirmation forgot the edge it found: the next trial's
        risk list (``headroom.save_risks``) cleared the successes beside it."""
        by_number = {}
        for row in rows(self.study):
            self.observe_row(row)
            by_number[row.number] = row
        if self.planner is None:
            return
        for number, c in confirmations(self.study).items():
            if c.status == Status.OOM and number in by_number:
                params = by_number[number].params
                self.planner.observe(number, params, Status.OOM, c.oom_kind, None, leftover=c.leftover)
        for inc in incidents(self.study):
            if inc.status == "oom":
                self.planner.observe(-inc.number, inc.params, "oom", inc.oom_kind, None)


class TrialSteps(Protocol):
    """What the scheduler asks of a search for each trial (``search.loop.Search`` implements it)."""

    def gate(
        self, number: int, params: dict[str, Any], previous: Previous | None
    ) -> tuple[Outcome | None, float | None]: ...

    def measure(
        self, trial: optuna.Trial, params: dict[str, Any], launched: int, predicted_gib: float | None
    ) -> Outcome: ...

    def tell(self, trial: optuna.Trial, params: dict[str, Any], key: str, outcome: Outcome) -> None: ...

    def converged(self, launched: int) -> str | None: ...
