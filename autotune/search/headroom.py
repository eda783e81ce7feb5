"""Headroom without a measured peak: when a trainer logs no memory and NVML cannot see the GPUs.

A trial that ran fine but whose peak nobody measured may sit a few percent under capacity and die
later in the real run, when the allocator's creep reaches it. Its headroom is judged instead by what
the search knows: a measured out-of-memory of a configuration that needs no more memory by every knob
whose effect is known (then this one is at the edge), or the calibrated memory model's prediction
with its margin (only where the model is trusted for this trainer). What is judged at risk is passed
over by the export (``study.ranking.eligible``) with the reason, and summary.md and ``show`` say that
the peak was not measured.
"""

from __future__ import annotations

from dataclasses import replace

import optuna

from autotune.candidate.vector import at_least
from autotune.search.planner import Planner, Seen
from autotune.search.trade import costly_values
from autotune.study.ranking import MIN_NOISE, confirmations, headroom_limit, noise
from autotune.study.record import AT_RISK_ATTR, LONG_RUN_CLEARS_ATTR, rows


def fits_headroom(peak_gib: float | None, limit: float | None) -> bool:
    """Whether a measured peak leaves the headroom free (an unmeasured one is judged elsewhere)."""
    return limit is None or peak_gib is None or peak_gib <= limit


def incumbent(planner: Planner) -> Seen | None:
    """The fastest measured success that keeps the headroom free: what the export could pick now.

    Every "can anything still beat the best?" is asked against this one. A trial that ran but
    peaked inside the headroom is never exported, so it must not set the bar: when it did, a 14B
    search stopped "converged" after 9 trials at 0.82 of the best possible, measured against a
    throughput it could not export. Nor does one a longer run took away (``Planner.passed_over``).
    """
    return max(exportable(planner), key=lambda s: s.throughput or 0.0, default=None)


def exportable(planner: Planner) -> list[Seen]:
    """The measured successes the export could pick by what the planner knows: a throughput, a peak
    that keeps the headroom free, not taken away by a longer run (``Planner.passed_over``)."""
    limit = headroom_limit(planner.recipe)
    return [
        s
        for s in planner.seen
        if s.status == "ok"
        and s.throughput
        and fits_headroom(s.peak_gib, limit)
        and s.number not in planner.passed_over
    ]


def unmeasured_risks(planner: Planner, spread: float) -> tuple[dict[str, str], list[str]]:
    """{trial number: why} for successful trials without a measured peak that may not keep headroom,
    and the numbers among them whose risk a longer run that holds clears.

    An OOM of a configuration that needs no more memory by every knob whose effect is known puts a
    success at the edge. Where the two also differ in a knob whose direction measurements showed
    (``KnobMemory.learned``, or ``hinted``: seen at one setting of the other knobs only) and this one has the
    value that needs less, that knob may be why one ran and the other died, or the learned direction may
    be an edge's coin (both ran at the edge, one died): a confirmation, a run as long as the export is
    judged by, tells the two apart. One OOM/ok pair at a 50/50 edge and one held confirmation are two
    coins, so the learned knob counts only where this success's value was also measured to cost speed,
    as every saver does (``trade.costly_values``, ``spread`` the measured noise). Seen: a trainer
    logging no memory, micro-batch 8 out of memory without activation offload and nine trials of it with
    offload fine; all nine were passed over and micro-batch 4 exported (0.85).
    Learned directions alone never take a success off the edge (tests/test_search_learned.py).
    """
    recipe = planner.recipe
    limit = recipe.gpu_memory_gib * (1 - recipe.headroom)
    ooms = [s for s in planner.seen if s.status == "oom" and s.oom_kind == "cuda" and not s.leftover]
    # by what is known beforehand only: directions learned from trials at the edge, where the same
    # configuration runs once and dies the next time, are no proof that a knob moved it off the edge
    known = replace(planner.knobs, learned={})
    shown = planner.knobs.shown
    slower = set(costly_values(planner, spread)) if shown else set()
    out: dict[str, str] = {}
    clears: list[str] = []
    for s in planner.seen:
        if s.status != "ok" or s.peak_gib is not None:
            continue
        vec = planner.vector(s.params, known)
        # (its own longer run that died is the ranking's to tell, in its own words)
        edges = [o for o in ooms if o.number != s.number and at_least(vec, planner.vector(o.params, known))]
        if edges:
            out[str(s.number)] = (
                f"trial {edges[0].number}, which needs no more memory by every knob whose effect is "
                "known, ran out of memory"
            )
            savers = {n: d for n, d in shown.items() if (n, s.params.get(n)) in slower}
            apart = replace(planner.knobs, learned=savers)
            full = planner.vector(s.params, apart)
            if savers and all(not at_least(full, planner.vector(o.params, apart)) for o in edges):
                clears.append(str(s.number))
            continue
        if planner.use_model and planner.model_trusted:
            predicted = planner.predict(s.params)
            margin = max(planner.margin, 2 * planner.rel_error)
            if predicted * (1 + margin) > limit:
                out[str(s.number)] = (
                    f"the calibrated model predicts {predicted:.1f} GiB (+{margin:.0%} margin), above the "
                    f"{limit:.1f} GiB headroom limit"
                )
    return out, clears


def save_risks(study: optuna.Study, planner: Planner | None) -> None:
    """Keep :func:`unmeasured_risks` in the study, where the export's ranking reads them."""
    if planner is None:
        risks, clears = {}, []
    else:
        # the noise is read from the storage (every trial) only where a learned or hinted knob may
        # clear a risk
        spread = noise(rows(study), confirmations(study)) if planner.knobs.shown else MIN_NOISE
        risks, clears = unmeasured_risks(planner, spread)
    if risks != (study.user_attrs.get(AT_RISK_ATTR) or {}):
        study.set_user_attr(AT_RISK_ATTR, risks)
    if clears != (study.user_attrs.get(LONG_RUN_CLEARS_ATTR) or []):
        study.set_user_attr(LONG_RUN_CLEARS_ATTR, clears)
