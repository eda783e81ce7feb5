"""A study measures its steps' own noise and stops measuring a run more steps cannot lift (issue 19).

A GPU's step times move from step to step about as much as from run to run, or more
(docs/gpu-validation.md, sixth lease). More steps of a trial average only that part, so a trial below
the best by more than twice what its steps could be off is measured: the steps it would still run
cost time and change nothing the search decides. A runner-up's confirmation is cut by the same rule
against what it needs to win the choice.
"""

import math
import re

import optuna
import pytest
from conftest import make_search

from autotune.recipe import Recipe
from autotune.search.confirm import confirm, runner_up_bar
from autotune.study import rows
from autotune.study.incidents import Incident, long_run_failures, save_incident
from autotune.study.ranking import (
    MIN_PAIRS,
    Confirmation,
    choose_best,
    confirmations,
    confirmed_verdict,
    eligible,
    judged,
    noise,
    step_noise,
)
from autotune.study.record import TrialRow
from autotune.trial.control import StopRule, TrialControl, first_pair
from autotune.trial.layout import TrialFiles
from autotune.trial.metrics import StepRecord
from autotune.trial.outcome import Outcome, Status

RECIPE = Recipe(model="Qwen2.5-0.5B", gpus=1)  # warm-up 2, 3 measured steps


def steps(*times: float, span: int = 1) -> list[StepRecord]:
    """Records of steps 1, 2, ... (each ``span`` long), two steps of warm-up at 20 s first."""
    out = [StepRecord(step=1, step_time=20.0, samples=8), StepRecord(step=2, step_time=20.0, samples=8)]
    for k, t in enumerate(times, start=1):
        out.append(StepRecord(step=2 + k * span, step_time=t, samples=8, span=span))
    return out


def test_the_first_measured_pair_is_a_log_ratio_of_single_steps():
    assert first_pair(steps(2.0, 2.5, 9.0), 2) == pytest.approx(math.log(1.25))
    assert first_pair(steps(2.0), 2) is None  # one measured step: no pair yet
    two = steps()[:2] + [StepRecord(4, 2.0, 8, span=2), StepRecord(5, 2.5, 8)]
    assert first_pair(two, 2) is None  # steps 3-4 in one record: an average has less spread
    gap = steps(2.0) + [StepRecord(step=5, step_time=2.5, samples=8)]
    assert first_pair(gap, 2) is None  # step 4 not logged: not neighbours


def test_the_step_noise_pools_each_trials_first_pair():
    def row(n: int, pair: float | None) -> TrialRow:
        return TrialRow(number=n, params={}, status="ok", throughput=1.0, step_pair=pair)

    few = [row(n, 0.1) for n in range(MIN_PAIRS - 1)] + [row(99, None)]
    assert step_noise(few) is None  # not enough pairs to act on
    pairs = [0.1, -0.1, 0.2, -0.2, 0.0, 0.1]
    many = [row(n, p) for n, p in enumerate(pairs)] + [row(99, None)]
    # two steps of sd s differ by sd s * sqrt(2)
    assert step_noise(many) == pytest.approx(math.sqrt(sum(p * p for p in pairs) / len(pairs) / 2))


def a_trial_behind(best: float) -> optuna.Trial:
    """A running trial of a study whose best finished trial measured ``best``/s."""
    study = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    study.add_trial(optuna.trial.create_trial(value=best))
    return study.ask()


def test_a_trial_out_of_reach_of_the_best_is_measured_at_once():
    """Best 10/s, 5% step noise: after one measured step a trial at 6/s would need its one step off by
    50%, ten standard errors: it is measured there, not after its three (or six) usual steps."""
    behind = a_trial_behind(10.0)
    slow = steps(8 / 6)  # 6/s after one measured step
    control = TrialControl(StopRule.searching(RECIPE), behind, 8, step_noise=0.05)
    assert control.decide(slow, 3) == "measured"
    # within twice its standard error (5% over one step) of the best: its steps go on
    close = steps(8 / 9.2)
    assert (
        TrialControl(StopRule.searching(RECIPE), a_trial_behind(10.0), 8, step_noise=0.05).decide(close, 3)
        is None
    )
    # and a noisier study needs more steps to rule the same trial out: at 30%, 6/s after one step is
    # within reach (6 * e^0.6 = 10.9), after three steps at 6/s it is not (6 * e^(0.6 / sqrt 3) = 8.5)
    noisy = TrialControl(StopRule.searching(RECIPE), a_trial_behind(10.0), 8, step_noise=0.30)
    assert noisy.decide(slow, 3) is None
    assert noisy.decide(steps(8 / 6, 8 / 6.6, 8 / 5.4), 5) == "measured"


def test_nothing_is_cut_before_the_study_knows_its_noise_nor_in_a_confirmation():
    behind = a_trial_behind(10.0)
    slow = steps(8 / 6)
    # as before: 6/s is above the pruner's half of the best, and one step is not measured
    assert TrialControl(StopRule.searching(RECIPE), behind, 8).decide(slow, 3) is None
    # a run that is not prunable (a confirmation's rule) measures its steps whatever they show
    confirming = TrialControl(StopRule.confirming(RECIPE), a_trial_behind(10.0), 8, step_noise=0.05)
    assert confirming.decide(slow, 3) is None
    # nothing finished that fits: no best to be out of reach of
    study = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    assert TrialControl(StopRule.searching(RECIPE), study.ask(), 8, step_noise=0.05).decide(slow, 3) is None


def test_a_search_pools_its_steps_and_stops_measuring_what_cannot_win(tmp_path):
    """Through the search loop on the simulator (3% run noise, steps at a third of it): every trial
    that measured two steps keeps its first pair; once six did, a trial far behind the best stops
    after its first measured step, counted as measured (exportable, taught to the planner), where
    before every trial that ran measured at least two."""
    written: dict[int, float | None] = {}  # each trial's pair in the outcome.json its execute wrote

    def execute(params, trial_dir, number, control):
        outcome = search.runner.run(params, trial_dir, number, control)
        written[number] = Outcome.read(TrialFiles(trial_dir).outcome).extra.get("step_pair")
        return outcome

    search = make_search(tmp_path, trials=16, patience=0, confirm=0, execute=execute)
    search.run()
    study = search.state.study
    ran = [r for r in rows(study) if r.status == "ok" and r.launched]
    assert sum(r.step_pair is not None for r in ran) >= MIN_PAIRS
    noise = step_noise(ran)
    assert noise is not None and 0.001 < noise < 0.05  # the simulator's 1% from step to step
    # each pair is on disk with its trial's outcome before the study is told, where a controller
    # killed in between resumes the trial from
    assert all(written[r.number] == r.step_pair for r in ran)
    measured = {r.number: Outcome.read(TrialFiles(search.paths.trial_dir(r.number)).outcome) for r in ran}
    cut = [r for r in ran if measured[r.number].steps == search.recipe.warmup_steps + 1]
    assert cut, "no trial was measured after one step"
    assert not any(r.pruned for r in cut)
    best = max(r.throughput or 0 for r in ran)
    assert all((r.throughput or 0) * math.exp(2 * noise) < best for r in cut)


def test_a_runner_ups_confirmation_out_of_reach_of_winning_is_cut():
    """A confirmation runs its nine steps, except a runner-up's whose throughput so far stays below
    the bar it must reach to win the choice by more than twice its steps' standard error."""
    slow = steps(8 / 6)  # 6/s after one measured step
    cut = TrialControl(StopRule.confirming(RECIPE), None, 8, purpose="confirm", step_noise=0.05, bar=10.0)
    assert cut.decide(slow, 3) == "measured" and cut.cut
    close = TrialControl(StopRule.confirming(RECIPE), None, 8, purpose="confirm", step_noise=0.05, bar=6.5)
    assert close.decide(slow, 3) is None and not close.cut  # 6 * e^0.1 = 6.63: within reach
    # no bar (the first leader's run) or no step noise yet: all nine measured steps, whatever they show
    for control in (
        TrialControl(StopRule.confirming(RECIPE), None, 8, purpose="confirm", step_noise=0.05),
        TrialControl(StopRule.confirming(RECIPE), None, 8, purpose="confirm", bar=10.0),
    ):
        nine = steps(*[8 / 6] * 9)
        assert [control.decide(nine[: 2 + k], 2 + k) for k in range(1, 9)] == [None] * 8
        assert control.decide(nine, 11) == "measured" and not control.cut


def test_the_bar_is_what_a_runner_up_needs_for_both_its_runs_to_win():
    """Both runs are judged by their geometric mean: a runner-up whose short trial ran 12/s against a
    best judged at 10/s must confirm at 100/12 to tie it."""
    row = TrialRow(number=4, params={}, status="ok", throughput=12.0)
    bar = runner_up_bar(row, 10.0)
    assert bar == pytest.approx(100 / 12)
    assert judged(row, Confirmation(Status.OK, throughput=bar, steps=11)) == pytest.approx(10.0)
    assert runner_up_bar(row, 0.0) is None  # nothing held yet: the first leader runs in full
    assert runner_up_bar(TrialRow(number=5, params={}, status="ok"), 10.0) is None


def test_a_cut_run_is_settled_as_slower_not_held():
    """The choice judges only runs that held all their steps; a cut run's gap to its short trial was
    what cut it, so it is not noise measured; nor does it clear a risk a longer run would clear."""
    short = {1: 10.0, 2: 12.0}
    trials = [
        TrialRow(number=n, params={"b": n}, status="ok", throughput=t, launched=True)
        for n, t in short.items()
    ]
    done = {
        1: Confirmation(Status.OK, throughput=9.5, steps=11),
        2: Confirmation(Status.OK, throughput=9.0, steps=3, cut_below=9.5 * 10 / 12 * 1.3),
    }
    # trial 2's two runs judged would be sqrt(12 * 9) = 10.4 > sqrt(10 * 9.5) = 9.7; it was cut, so no
    best, _ = choose_best(trials, RECIPE, done)
    assert best is not None and best.number == 1
    assert noise(trials, done) == pytest.approx(0.05)  # trial 1's gap alone, not trial 2's 25%
    assert "stopped at 9/s" in confirmed_verdict(trials[1], done[2])
    risky = TrialRow(
        number=2,
        params={},
        status="ok",
        throughput=12.0,
        launched=True,
        at_risk="trial 9 ran out of memory",
        long_run_clears=True,
    )
    passed: dict[int, str] = {}
    eligible([risky], RECIPE, {2: done[2]}, passed_over=passed)
    assert "no longer run has cleared it" in passed[2]


def test_a_search_cuts_a_runner_ups_confirmation_and_counts_it_settled(tmp_path):
    """Through the search loop on the simulator (3% run noise, 1% step noise): the leader's longer run
    measures its nine steps; runners-up whose longer runs fall out of reach of winning are stopped
    after their first measured step, keep the bar they missed, count among the three --confirm
    settles (no fourth is run) and are never exported."""
    search = make_search(tmp_path, trials=16, seed=0)
    result = search.run()
    study = search.state.study
    done = confirmations(study)
    full = search.recipe.warmup_steps + 3 * search.recipe.measure_steps
    held = {n: c for n, c in done.items() if c.held}
    cut = {n: c for n, c in done.items() if c.cut_below is not None}
    assert held and cut, done
    assert all(c.steps == full for c in held.values())
    assert all(c.steps < full for c in cut.values())
    assert len(done) == search.recipe.confirm  # the cut ones are settled: no further leader is run
    assert result.best is not None and result.best.number in held
    noise_ = step_noise(rows(study))
    by_number = {r.number: r for r in rows(study)}
    (leader,) = held  # here the leader alone held: every bar was set by both its runs
    win = judged(by_number[leader], held[leader])
    for number, c in cut.items():
        # exactly the bar: a rounded one no longer "stands" against the bar computed again, and a
        # settled run was confirmed again and again (held-out verl 3B, bars below 0.5/s)
        assert c.cut_below == runner_up_bar(by_number[number], win)
        measured = c.steps - search.recipe.warmup_steps
        assert (c.throughput or 0) * math.exp(2 * noise_ / math.sqrt(measured)) < c.cut_below
        kept = Outcome.read(TrialFiles(search.paths.confirm_dir(number)).outcome)
        assert kept.extra["cut_below"] == c.cut_below
    assert confirm(search.state, search.execute) == 0  # settled: asked again, nothing more is run
    # summary.md's runners-up say each was stopped, and never name one as not measurably slower
    summary = (search.paths.best / "summary.md").read_text()
    close = re.search(r"Not measurably slower than the choice: trials? (.*?), by both runs", summary)
    named = {n.split()[0] for n in close.group(1).split(", ")} if close else set()
    for number, c in cut.items():
        (line,) = [line for line in summary.splitlines() if line.startswith(f"| {number} |")]
        assert c.cut_note in line
        assert str(number) not in named


def test_a_cut_run_whose_bar_fell_is_confirmed_again(tmp_path):
    """The leader that set the bars is lost afterwards (its production run ran out of memory): the
    runners-up cut against it were settled against a bar that no longer stands, so the next
    confirmation confirms them again (the first in full) and exports one that held; each cut run's
    folder is kept beside the new one."""
    search = make_search(tmp_path, trials=16, seed=0)
    search.run()
    study = search.state.study
    done = confirmations(study)
    (leader,) = [n for n, c in done.items() if c.held]
    cut = sorted((n for n, c in done.items() if c.cut_below is not None), key=lambda n: -short_of(study, n))
    params = {r.number: r.params for r in rows(study)}
    save_incident(study, Incident(1, 1, "oom", "cuda", 120, "CUDA out of memory.", params[leader]))
    assert confirm(search.state, search.execute) >= 1
    again = confirmations(study)
    first = again[cut[0]]
    assert first.held and first.steps == search.recipe.warmup_steps + 3 * search.recipe.measure_steps
    old = search.paths.confirm_dir(cut[0]).with_name(f"{cut[0]}-cut")
    assert Outcome.read(TrialFiles(old).outcome).extra["cut_below"] == pytest.approx(done[cut[0]].cut_below)
    best, _ = choose_best(rows(study), search.recipe, again, long_run_failures(study))
    assert best is not None and best.number != leader and again[best.number].held


def short_of(study, number: int) -> float:
    return next(r.throughput or 0.0 for r in rows(study) if r.number == number)
