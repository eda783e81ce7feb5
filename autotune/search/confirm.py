"""Confirmation: re-run the leading candidates longer before anything is exported.

Configs within a few percent of capacity can pass a short trial and die steps later when
fragmentation creeps; a longer run at full lengths catches that before it is exported, and judging
the survivors by both their runs (:func:`autotune.study.ranking.judged`) takes noise out of the
choice.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from autotune.candidate import constraints
from autotune.recipe import Recipe
from autotune.runners.base import on_gpus
from autotune.search.headroom import save_risks
from autotune.search.state import Finished, SearchState, short_and_left
from autotune.search.transient import transient_error
from autotune.study import (
    StudyPaths,
    TrialRow,
    confirmations,
    eligible,
    launched_rows,
    rows,
    save_confirmation,
)
from autotune.study.incidents import long_run_failures
from autotune.study.ranking import CUT_BELOW, MIN_NOISE, Confirmation, judged, noise, step_noise
from autotune.trial.control import CONFIRM_FACTOR, StopRule, TrialControl
from autotune.trial.execute import abort_on_error
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import Outcome, Status

CONFIRM_NUMBER_OFFSET = 100_000  # confirmation runs are numbered apart from search trials


def confirm_duration(row: TrialRow, recipe: Recipe) -> float:
    """A confirmation's expected wall time: its short trial's, scaled by the steps it runs."""
    short_steps = recipe.warmup_steps + recipe.measure_steps
    return (
        (row.wall_time_s or 0.0) * (recipe.warmup_steps + recipe.measure_steps * CONFIRM_FACTOR) / short_steps
    )


def confirm(
    state: SearchState, execute: Callable[..., Outcome], slots: list[list[int] | None] | None = None
) -> int:
    """Confirm leaders by longer runs, only as many as it takes to separate them from the noise.

    The fastest eligible trial is confirmed first. A runner-up is confirmed too only while its short-
    trial throughput, plus twice the noise, could still beat the best confirmed throughput (a near-tie is
    decided by the confirmations, each beside its short trial), until ``recipe.confirm`` have held or were
    settled as slower (a runner-up's run is stopped once it is out of reach of winning:
    :func:`runner_up_bar`), in at most ``recipe.confirm`` + 2 runs (the two more stand in for leaders that
    die in their longer run). Held confirmations count only while their leader can still be exported
    (another leader's dead run can put it at the edge, a production run can have lost it): a bar the
    export cannot meet would leave the export a short trial alone. A candidate ahead of every confirmed
    one by more than the noise is always confirmed, so a resumed search that found a better configuration
    exports it. Each run is admitted only if its own expected length fits the time budget, and the study's
    clock is saved after each. With several GPU ``slots`` the leaders still needed are confirmed at once,
    one per slot. A run that ran out of memory is learned from (:meth:`SearchState.observe`); one that
    held teaches nothing the short trial did not. Returns the runs made now.
    """
    study, recipe, paths, reporter, budget = (
        state.study,
        state.recipe,
        state.paths,
        state.reporter,
        state.stopping.budget,
    )
    if recipe.confirm <= 0:
        return 0
    failed = long_run_failures(study)  # what a production run lost is never confirmed, nor a bar
    runs = 0
    slots = slots or [None]
    while runs < recipe.confirm + 2:
        done = confirmations(study)
        all_rows = rows(study)
        candidates, _ = eligible(all_rows, recipe, done, failed_long=failed, confirming=True)
        # the candidates' held confirmations only (eligible passes over one that died or peaked inside
        # the headroom): one whose leader a later OOM put at the edge sets no bar the export could meet
        held_rows = [r for r in candidates if r.number in done and done[r.number].held]
        held = [done[r.number] for r in held_rows]
        win = max((judged(r, done[r.number]) for r in held_rows), default=0.0)
        # a runner-up cut below its bar is settled as slower (one of the --confirm N) while that bar
        # stands; where the leader that set it was lost since (an OOM put it at the edge, a production
        # run failed it), it is confirmed again, in full or against the bar that stands now
        cut = [r for r in candidates if r.number in done and done[r.number].cut_below is not None]
        again = {r.number for r in cut if not bar_stands(done[r.number], runner_up_bar(r, win))}
        settled = len(held) + len(cut) - len(again)
        # the best confirmation alone: which leaders are confirmed does not depend on how the
        # choice then weighs each one's two runs (study.ranking.judged)
        best = max((c.throughput or 0.0 for c in held), default=0.0)
        spread = noise(all_rows, done)
        # a near-tie is decided by the confirmations: a short trial can be lucky (or unlucky) by
        # the noise, and so can the one it is compared with, hence twice the noise
        todo = [
            r
            for r in candidates
            if (r.number not in done or r.number in again) and (r.throughput or 0) * (1 + 2 * spread) > best
        ]
        if settled >= recipe.confirm:
            # --confirm N is N candidates that held or were settled as slower (each full run costs
            # about 1.5 trials); beyond them, only one whose short trial beats the best confirmed by
            # more than the noise
            todo = [r for r in todo if (r.throughput or 0) > best * (1 + spread)]
        if not todo:
            break
        # with several GPU slots, the leaders still needed are confirmed at once, one per slot
        wanted = max(1, min(len(slots), recipe.confirm - settled, recipe.confirm + 2 - runs))
        batch = []
        for row in todo[:wanted]:
            if budget.exceeded(confirm_duration(row, recipe)):
                reporter.message(
                    f"not confirming trial {row.number}: its longer run would exceed --time-budget"
                )
                break
            batch.append(row)
        if not batch:
            break
        for row in batch:
            reporter.message(
                f"confirming trial {row.number} with {recipe.measure_steps * CONFIRM_FACTOR} measured steps"
            )
        for row in batch:
            if row.number in again:  # its cut run's folder is kept beside the new one
                set_aside(paths.confirm_dir(row.number), "cut")
        bars = [runner_up_bar(r, win) for r in batch]
        one = partial(run_one, recipe=recipe, paths=paths, execute=execute, steps=step_noise(all_rows))
        if len(batch) == 1:
            outcomes = [one(batch[0], slots[0], bars[0])]
        else:
            pool = ThreadPoolExecutor(len(batch), thread_name_prefix="confirm")
            with abort_on_error(pool):
                outcomes = list(pool.map(one, batch, slots, bars))
        for row, outcome in zip(batch, outcomes):
            save_confirmation(study, row.number, outcome)
            budget.spent(outcome.wall_time_s)
            if outcome.status == Status.OOM:
                state.observe(Finished.of_outcome(row.number, row.params, outcome, launched=True))
                # the next leader is chosen by the at-risk list this OOM may have grown
                save_risks(study, state.planner)
            stopped = Confirmation.from_attr(outcome.to_json()).cut_note
            reporter.message(
                f"confirmation of trial {row.number}: {outcome.status}"
                + (f" {outcome.throughput:.3g}/s" if outcome.throughput else "")
                + (f", peak {outcome.peak_memory_gib:.1f} GiB" if outcome.peak_memory_gib else "")
                + (f", {stopped}" if stopped else "")
            )
            runs += 1
        study.set_user_attr("elapsed_s", round(budget.elapsed(), 1))  # a resume goes on from here
    return runs


def runner_up_bar(row: TrialRow, win: float) -> float | None:
    """The confirmed throughput ``row`` needs to win the choice: with both its runs judged
    (:func:`autotune.study.ranking.judged`, the geometric mean), its confirmation must reach
    ``win**2 / short``, where ``win`` is the best judged figure of the confirmations that held. None
    for the first leader (nothing held yet) or a row without a short throughput: measured in full.

    A runner-up whose confirmation stays below this bar by more than its steps' noise can allow is
    stopped there (``TrialControl.out_of_reach``): the choice would not pick it, and its remaining
    steps (a confirmation costs about 1.5 trials) would buy nothing."""
    short = row.throughput or 0.0
    return win * win / short if win and short else None


def bar_stands(c: Confirmation, bar: float | None) -> bool:
    """Whether a run cut below ``c.cut_below`` is still below what it needs to win now (``bar``,
    :func:`runner_up_bar` of the confirmations that hold now): the bar it was cut at is no higher
    (up to float noise, and the six decimal places studies before the bar was kept unrounded stored)."""
    return bar is not None and c.cut_below is not None and c.cut_below <= bar * (1 + 1e-6) + 5e-7


def set_aside(folder: Path, why: str) -> None:
    """Rename a run's folder to ``<name>-<why>`` (``-<why>-2``, ... where taken) before the same run
    is made again: a user's files are never overwritten."""
    kept, n = folder.with_name(f"{folder.name}-{why}"), 1
    while kept.exists():
        n += 1
        kept = folder.with_name(f"{folder.name}-{why}-{n}")
    if folder.exists():
        folder.rename(kept)


def searching_on(state: SearchState, stopped: str | None) -> float | None:
    """The best short trial still exportable (0.0 when none is), when the search should go on from
    it; else None.

    A search that stopped as converged counted its patience against its best short trial. When a
    longer run took that trial away (its confirmation died or peaked inside the headroom, or a
    production run lost it) and every exportable trial is slower by more than :data:`MIN_NOISE` (the
    bar's own trial is gone, not a near-tie), the trials since were judged against a bar nothing can
    be exported at, while trials are left: the search goes on (once, :meth:`Search.run`) from what
    can be. Not where the short trials' leader was an unmeasured peak an OOM put at risk (the search
    knew that before it stopped), nor where the bar's own peak was never measured (a trainer that
    logs no memory, no NVML): there the search knows the edge only by its OOMs, and each OOM that
    going on adds puts the successes beside it at risk, the confirmed ones too (a plain 0.5B trainer
    went on after its leader died in a longer run and exported 0.35 of the best possible in place of
    a confirmed 1.00). Seen: a QLoRA 7B whose four leaders all peaked inside the headroom in their
    longer runs stopped after 16 of 30 trials and exported 0.93 of the best possible; going on, it
    exported 0.99 (docs/benchmarks-notes.md, thirty-second and thirty-third passes)."""
    study, recipe = state.study, state.recipe
    if stopped is None or ": converged" not in stopped or state.stopping.budget.exceeded():
        return None
    if len(launched_rows(study)) >= recipe.trials:
        return None
    short, left = short_and_left(study, recipe)
    if left and left[0].peak_memory_gib is None:
        return None  # its headroom is judged by the OOMs around it: going on would add more
    value = left[0].throughput or 0.0 if left else 0.0  # the short trials' leader, if still there
    return value if short and (short[0].throughput or 0.0) > value * (1 + MIN_NOISE) else None


def search_on(state: SearchState, bar: float) -> str:
    """Go on from ``bar`` (:func:`searching_on`): the patience counted again from what can be
    exported (:meth:`SearchState.rebar`); returns the note the search's final stop reason carries."""
    why = f"from {bar:.3g} completions/s: a longer run took away the best it converged on"
    state.reporter.message(f"searching on {why}")
    state.rebar()
    return f" (searched on {why})"


def run_one(
    row: TrialRow,
    gpus: list[int] | None,
    bar: float | None,
    *,
    recipe: Recipe,
    paths: StudyPaths,
    execute: Callable[..., Outcome],
    steps: float | None = None,
) -> Outcome:
    """One confirmation run, on ``gpus`` (a parallel slot) or the default GPUs, stopped early only
    below ``bar`` (:func:`runner_up_bar`) by more than the study's step noise ``steps`` allows (the
    outcome then says so under ``extra["cut_below"]``). A run that dies of a known transient error
    (an NCCL watchdog timeout) is run once more, its first folder kept beside it as
    ``<n>-crashed``: such a crash says nothing about the candidate."""
    trial_dir = paths.confirm_dir(row.number)
    for attempt in range(2):
        control = TrialControl(
            StopRule.confirming(recipe),
            None,
            constraints.samples_per_step(row.params, recipe),
            purpose="confirm",
            step_noise=steps,
            bar=bar,
        )
        with on_gpus(gpus):
            outcome = execute(row.params, trial_dir, CONFIRM_NUMBER_OFFSET + row.number, control)
        if control.cut and bar is not None:
            # unrounded: bar_stands compares it with the bar computed anew (rounded to six places, a
            # bar below 0.5/s no longer stood, and its run was confirmed again up to the run limit)
            outcome.extra[CUT_BELOW] = bar
        outcome.write(TrialFiles(trial_dir).outcome)
        if (
            attempt
            or outcome.status != Status.CRASH
            or not transient_error(outcome.error_line, outcome.detail)
        ):
            break
        kept = trial_dir.with_name(f"{trial_dir.name}-crashed")
        if kept.exists():
            break  # an earlier session's: keep both, do not overwrite
        trial_dir.rename(kept)
    return outcome
