"""Which trial wins: ranking, the headroom rule, and the longer confirmation runs.

A trial is exportable only when it ran, measured its throughput, left ``headroom`` of GPU memory
free (on CPU: of ``--memory-limit``, when one is given; see :func:`headroom_limit`) and, when it
was re-run longer, survived that run too. Among those, a confirmed candidate beats an unconfirmed
one, and confirmed candidates are judged by both their runs (:func:`judged`): short trials of
configurations within a few percent of each other are ranked by noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna

from autotune.recipe import Recipe
from autotune.study.record import TrialRow, candidate_key
from autotune.trial.outcome import Outcome, Status

MIN_NOISE = 0.03  # relative run-to-run noise assumed before any run was repeated
MIN_PAIRS = 6  # trials whose first measured steps pooled give a step noise worth acting on
CUT_BELOW = "cut_below"  # Outcome.extra of a confirmation stopped below its bar (Confirmation.cut_below)


@dataclass(frozen=True)
class Confirmation:
    """A leader's longer confirmation run, as the study keeps it (user attribute ``confirm:<n>``,
    the run's outcome.json)."""

    status: Status
    throughput: float | None = None
    peak_memory_gib: float | None = None
    steps: int = 0
    oom_kind: str | None = None
    leftover: bool = False  # started beside a predecessor's memory: an OOM of it says nothing of itself
    # a runner-up's run stopped below the throughput it needed to win the choice (its bar), before its
    # steps were done: settled as slower, but its long run's memory was not checked in full
    cut_below: float | None = None

    @property
    def ended(self) -> str:
        """How the run ended, as reports name it: ``oom/cuda``, ``crash``, ``ok``."""
        return f"{self.status}/{self.oom_kind}" if self.oom_kind else str(self.status)

    @classmethod
    def from_attr(cls, value: dict[str, Any]) -> Confirmation:
        return cls(
            Status(value["status"]),
            value.get("throughput"),
            value.get("peak_memory_gib"),
            value.get("steps") or 0,
            value.get("oom_kind"),
            bool(value.get("leftover_gib")),
            (value.get("extra") or {}).get(CUT_BELOW),
        )

    @property
    def held(self) -> bool:
        """It ran all its steps and survived them: what the choice judges (:func:`choose_best`)."""
        return self.status == Status.OK and self.cut_below is None

    @property
    def cut_note(self) -> str:
        """How every report names a run cut below its bar ("" for any other)."""
        if self.cut_below is None:
            return ""
        return (
            f"stopped at {self.throughput or 0:.4g}/s after {self.steps} steps, below the "
            f"{self.cut_below:.4g}/s it needed to win"
        )


def headroom_limit(recipe: Recipe) -> float | None:
    """The peak memory an exportable configuration may reach, or None when none applies.

    On GPUs, ``(1 - headroom)`` of the GPU's memory. On CPU, ``(1 - headroom)`` of ``--memory-limit``
    (the RLIMIT_AS cap each trial ran under, against the trial's peak RSS: the trainer's own figure
    or, when it reports none, the process tree's); without a cap the host's RAM is shared with
    everything else on it and no headroom is judged.
    """
    if recipe.device == "cpu":
        if not recipe.memory_limit_gib:
            return None
        return float(recipe.memory_limit_gib) * (1.0 - recipe.headroom)
    return recipe.gpu_memory_gib * (1.0 - recipe.headroom)


def rank(rows_: list[TrialRow]) -> list[TrialRow]:
    """Best first: ok trials by throughput, then the rest by trial number."""

    def good(r: TrialRow) -> bool:
        return r.status == "ok" and bool(r.throughput) and r.launched and not r.pruned

    ok = sorted((r for r in rows_ if good(r)), key=lambda r: -(r.throughput or 0))
    rest = sorted((r for r in rows_ if not good(r)), key=lambda r: r.number)
    return ok + rest


def eligible(
    rows_: list[TrialRow],
    recipe: Recipe,
    confirmed: dict[int, Confirmation] | None = None,
    passed_over: dict[int, str] | None = None,
    failed_long: dict[str, str] | None = None,
    confirming: bool = False,
) -> tuple[list[TrialRow], list[str]]:
    """Launched ok trials, fastest first, that left ``headroom`` of GPU memory free and, when a
    longer confirmation run was made, survived it with headroom too; plus why others were not.
    An unmeasured peak at risk that a longer run clears (``TrialRow.long_run_clears``) qualifies
    once its confirmation held, and is a candidate for one when ``confirming``.
    ``passed_over``, when given, receives each passed-over trial's reason by number (for ``show``);
    ``failed_long`` holds the configurations a production run lost to OOM or a hang (by candidate key,
    :func:`autotune.study.incidents.failed_long`): a long run outweighs any short trial. When no
    trial measured in full qualifies, the fastest one the pruner stopped early that does (it ran)."""
    confirmed = confirmed or {}
    notes: list[str] = []
    out: list[TrialRow] = []
    limit = headroom_limit(recipe)
    check_peak = limit is not None
    capacity = recipe.memory_limit_gib if recipe.device == "cpu" else recipe.gpu_memory_gib
    what_cap = "--memory-limit" if recipe.device == "cpu" else "capacity"

    def why_not(row: TrialRow) -> str | None:
        c = confirmed.get(row.number)
        if failed_long and candidate_key(row.params) in failed_long:
            return failed_long[candidate_key(row.params)]
        if check_peak and row.peak_memory_gib is None and row.at_risk:
            if not row.long_run_clears:
                return f"its peak was not measured and {row.at_risk}"
            if (c is None or c.cut_below is not None) and not confirming:
                return f"its peak was not measured and {row.at_risk}; no longer run has cleared it"
        if check_peak and row.peak_memory_gib is not None and row.peak_memory_gib > limit:
            return (
                f"peak {row.peak_memory_gib:.1f} GiB is within {recipe.headroom:.0%} of the "
                f"{capacity:.1f} GiB {what_cap}"
            )
        if c is not None and c.status != Status.OK:
            return f"it died in its longer confirmation run ({c.ended} after {c.steps} steps)"
        if c is not None and check_peak and c.peak_memory_gib is not None and c.peak_memory_gib > limit:
            return (
                f"its confirmation run peaked at {c.peak_memory_gib:.1f} GiB, within "
                f"{recipe.headroom:.0%} of the {capacity:.1f} GiB {what_cap}"
            )
        return None

    def ran(row: TrialRow) -> bool:
        return row.status == "ok" and bool(row.throughput) and row.launched

    for row in rank(rows_):
        if not ran(row) or row.pruned:
            break
        why = why_not(row)
        if why is None:
            out.append(row)
            continue
        notes.append(f"trial {row.number} ({row.throughput:.3g} completions/s) passed over: {why}")
        if passed_over is not None:
            passed_over[row.number] = why
    if not out:
        # every full measurement is passed over (a long run failed the fastest): a trial the pruner
        # stopped early as slower still ran without running out of memory, which is what a
        # production run restarts on (autotune.production.choice), so the export names it too
        # rather than leave best/ recommending what failed
        stopped = sorted((r for r in rows_ if ran(r) and r.pruned), key=lambda r: -(r.throughput or 0))
        fallback = next((r for r in stopped if why_not(r) is None), None)
        if fallback is not None:
            out.append(fallback)
            notes.append(
                f"trial {fallback.number} was stopped early as slower than the best then; nothing "
                "measured in full is left to export"
            )
    return out, notes


def judged(row: TrialRow, c: Confirmation) -> float:
    """What a confirmed candidate is judged by: the geometric mean of its short trial's throughput
    and its confirmation's. Both are runs of the same configuration, and of a run's noise a longer
    run averages away only the step-to-step part: where the run's own part dominates (placement,
    clocks, the allocator's luck), the two runs halve the variance the confirmation alone has; where
    the steps' part dominates, equal weights have about the variance of the confirmation alone (it
    measures three times the steps; more where the short trial stopped early, and then a little
    more). The leaders were picked for their short trials, so part of their luck comes back with
    them; measured on the benchmark's six seeds, the choice still gained (docs/benchmarks-notes.md,
    twenty-seventh pass)."""
    short = row.throughput or 0.0
    if c.status != Status.OK or not c.throughput or not short:
        return c.throughput or 0.0
    return math.sqrt(short * c.throughput)


def confirmed_verdict(row: TrialRow | None, c: Confirmation) -> str:
    """How ``show`` and the dashboard name a confirmed trial that was not exported: its
    confirmation, and the figure it was judged by (:func:`judged`), which another beat; the
    confirmation alone where the trial's row is not at hand (the dashboard reads finished trials). A
    runner-up's run cut below its bar says so: it was settled as slower, not confirmed."""
    if c.cut_below is not None:
        return f"longer run {c.cut_note}"
    both = f", both runs {judged(row, c):.4g}/s" if row is not None else ""
    return f"confirmed {c.throughput or 0:.4g}/s{both}"


def choose_best(
    rows_: list[TrialRow],
    recipe: Recipe,
    confirmed: dict[int, Confirmation] | None = None,
    failed_long: dict[str, str] | None = None,
) -> tuple[TrialRow | None, list[str]]:
    """The configuration to export, with notes on what was passed over and why.

    Before any confirmation: the fastest eligible trial. Once leading trials were confirmed by
    longer runs, the confirmed one judged fastest by both its runs wins (:func:`judged`): short
    trials of configs within a few percent of each other are ranked by noise, two runs less so.
    """
    confirmed = confirmed or {}
    candidates, notes = eligible(rows_, recipe, confirmed, failed_long=failed_long)
    if not candidates:
        return None, notes
    held = [r for r in candidates if r.number in confirmed and confirmed[r.number].held]
    if not held:
        if confirmed:
            notes.append(f"trial {candidates[0].number} was not confirmed by a longer run")
        return candidates[0], notes
    best = max(held, key=lambda r: judged(r, confirmed[r.number]))
    c = confirmed[best.number]
    peak = c.peak_memory_gib
    notes.append(
        f"trial {best.number} was confirmed by a run of {c.steps} steps: "
        f"{(c.throughput or 0):.3g} completions/s"
        + (f", peak {peak:.1f} GiB" if peak else "")
        + (
            f" (both runs {judged(best, c):.4g}, its short trial {best.throughput or 0:.4g}: "
            f"the best of {len(held)} confirmed)"
            if len(held) > 1
            else ""
        )
    )
    return best, notes


def confirmations(study: optuna.Study) -> dict[int, Confirmation]:
    """Outcomes of the longer confirmation runs, by the trial they confirm."""
    return confirmations_of(study.user_attrs)


def confirmations_of(attrs: dict[str, Any]) -> dict[int, Confirmation]:
    """:func:`confirmations` from a study's user attributes. One that is not as ``save_confirmation``
    writes it (another program's, or edited by hand) is left out: a study stays resumable."""
    out = {}
    for key, value in attrs.items():
        number = key.split(":", 1)[1] if key.startswith("confirm:") else ""
        if not (number.isdigit() and isinstance(value, dict)):
            continue
        try:
            out[int(number)] = Confirmation.from_attr(value)
        except (KeyError, ValueError):
            continue
    return out


def save_confirmation(study: optuna.Study, number: int, outcome: Outcome) -> None:
    study.set_user_attr(f"confirm:{number}", outcome.to_json())


def noise(rows_: list[TrialRow], done: dict[int, Confirmation]) -> float:
    """Relative measurement noise: how far confirmed throughputs landed from their short trials'.

    The search trials already measured every candidate once; a confirmation measures it again,
    longer, so the gap between the two is the noise that can reorder close candidates."""
    short = {r.number: r.throughput for r in rows_ if r.throughput}
    gaps = [  # not a run cut below its bar: it was stopped for being far from its short trial
        abs((c.throughput or 0) / short[n] - 1)
        for n, c in done.items()
        if c.held and c.throughput and short.get(n)
    ]
    return max([MIN_NOISE, *gaps])


def step_noise(rows_: list[TrialRow]) -> float | None:
    """One step's relative spread (sd of log step time), pooled over the study's trials: each trial's
    first two measured steps differ by sqrt(2) of it. None before :data:`MIN_PAIRS` trials measured
    two steps. Unlike :func:`noise`, it holds no run-to-run part (a placement's or a clock's luck,
    which every step of a run shares): it says what more steps of a run could still change."""
    pairs = [r.step_pair for r in rows_ if r.step_pair is not None]
    if len(pairs) < MIN_PAIRS:
        return None
    return math.sqrt(sum(p * p for p in pairs) / (2 * len(pairs)))
