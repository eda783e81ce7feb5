#!/usr/bin/env python
"""One benchmark run, trial by trial, beside its landscape's truth: what the notes read a miss by.

    python scripts/bench_inspect.py 1/6 [--trials 30] [--luck N] [--exact] [--oracle memory,prior]

``SEED/INDEX`` names a run as docs/benchmarks.md does (seed 1, landscape #6). The run is autotune's
search on that landscape exactly as ``scripts/bench_search.py --seed SEED [--luck N] [--exact] [--oracle
...]`` runs it (the same recipe, executor and seeds, so the same decisions), printed with what the
benchmark knows and the search does not: each launched trial's and each confirmation's value in truth,
the export's score, and the landscape's best configurations. A trial's knobs are shown where they differ
from the landscape's best, so a walk that never reached it shows which knobs it never moved. For a run
that exported something below 0.95 of the best possible (its value in truth), last, what the search's
planner thought at its end of the configurations at 0.95 fewest knobs from the export
(:func:`as_planned`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_landscapes import build_landscape  # noqa: E402
from bench_search import APART, oracle_of, policy_autotune, quiet, search_seed  # noqa: E402

from autotune.candidate.moves import knobs_apart  # noqa: E402
from autotune.sim.families import landscape  # noqa: E402
from autotune.study import candidate_key  # noqa: E402
from autotune.study.ranking import headroom_limit  # noqa: E402

TOP = 6  # the landscape's best configurations listed
TARGET = 0.95  # issue 19's share of the best possible


def run_of(text: str) -> tuple[int, int]:
    """``SEED/INDEX`` (``1/6``; ``1/#6`` as the report writes it); ValueError otherwise."""
    seed, _, index = text.partition("/")
    seed_n, index_n = int(seed), int(index.lstrip("#"))
    if not 0 <= seed_n < APART or index_n < 0:  # bench_search.py's --seed
        raise ValueError(text)
    return seed_n, index_n


def apart(params: dict[str, Any], best: dict[str, Any]) -> str:
    """The knobs of ``params`` that differ from ``best``, as knob=value."""
    return " ".join(f"{k}={params[k]}" for k in sorted(params) if params[k] != best.get(k)) or "(the best)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="SEED/INDEX, as docs/benchmarks.md names a run (1/6 or 1/#6)")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--luck", type=int, default=0, help="the run of bench_search.py ... --luck N")
    parser.add_argument(
        "--exact", action="store_true", help="the run of bench_search.py ... --exact (measured without noise)"
    )
    parser.add_argument(
        "--oracle", default="", help="the run of bench_search.py ... --oracle (its planner told the truth)"
    )
    args = parser.parse_args()
    oracle = oracle_of(args.oracle)
    if oracle is None:
        print(f"error: --oracle {args.oracle}: give memory, prior or memory,prior")
        return 2
    try:
        seed, index = run_of(args.run)
    except ValueError:
        print(f"error: {args.run}: name a run as SEED/INDEX, the seed 0-999, the index >= 0: 1/6")
        return 2
    if not 0 <= args.luck < APART:
        print(f"error: --luck {args.luck}: give the whole number the benchmark ran with, 0 to 999")
        return 2
    try:
        d = landscape(index, seed)
    except ValueError as exc:  # past the held-out families' ranges (sim/families.py)
        print(f"error: {args.run}: {exc}")
        return 2
    logging.basicConfig(level=logging.WARNING)
    quiet()
    land = build_landscape(d, args.trials, exact=args.exact)
    land.oracle = oracle
    run = policy_autotune(land, search_seed(seed, index, args.luck), args.trials)
    by_key = {candidate_key(c): c for c in land.candidates}
    ranked = sorted(land.safe.items(), key=lambda kv: -kv[1])
    best = by_key[ranked[0][0]]
    limit = headroom_limit(land.recipe) or 0.0
    noise = d.physics.noise
    print(f"{seed}/#{index} {d.family} {d.name}: best possible {land.best:.3g}/s, limit {limit:.1f} GiB,")
    print(
        f"  drawn noise {noise:.1%} from run to run, {d.physics.step_sigma:.1%} from step to step"
        f"{' (not applied: --exact)' if args.exact else ''}; "
        f"the best: {' '.join(f'{k}={v}' for k, v in sorted(best.items()))}"
    )
    print("launched trials (knobs apart from the best):")
    for ran in run.trials:
        print(f"  {ran.number:>3} {ran.proposer:<5} {ran.result}  {apart(ran.params, best)}")
    print("confirmations:")
    for ran in run.confirms:
        print(f"  {ran.result} (trial {ran.number})")
    if not run.confirms:
        print("  (none)")
    exported = apart(run.exported, best) if run.exported else "nothing"
    print(f"exported: {exported}; score {run.final / max(land.best, 1e-9):.3f} ({run.stopped})")
    print(f"the landscape's best {TOP} (value, knobs apart from the best):")
    for key, value in ranked[:TOP]:
        print(f"  {value / max(land.best, 1e-9):.3f} {apart(by_key[key], best)}")
    if run.exported and run.final < TARGET * land.best:
        print(f"the configurations at {TARGET} or better nearest the export, as the search left them:")
        good = [by_key[k] for k, v in ranked if v >= TARGET * land.best]
        ran = {candidate_key(r.params) for r in run.trials}
        for line in as_planned(run.planner, run.exported, good, ran, lambda c: land.value(c) / land.best):
            print(f"  {line}")
    return 0


def as_planned(
    planner: Any,
    exported: dict[str, Any],
    good: list[dict[str, Any]],
    ran: set[Any],
    value: Callable[[dict[str, Any]], float],
) -> list[str]:
    """What the planner, at the search's end, thought of the ``good`` configurations fewest knobs
    from the export: run by the search or not (``ran``: the keys of the trials launched, crashed ones
    included), ruled out and why, inside the headroom by the calibrated model or above it (or not
    judged, before a measured peak calibrates it), and the throughput it expected beside the
    export's, the prior as a factor of the export's. A miss that never ran a good configuration is
    read here: a prior blind to the knobs apart, a model that put it above the limit, an OOM that
    ruled it out."""
    if not good:
        return ["(no configuration reaches the target)"]
    fewest = min(knobs_apart(c, exported) for c in good)
    prior = planner.prior(exported)
    lines = [f"(the export: expected {planner.expected_throughput(exported):.3g}/s)"]
    for cand in [c for c in good if knobs_apart(c, exported) == fewest][:TOP]:
        verdict = planner.verdict(cand)
        judged = f"ruled out: {verdict.reason}" if verdict.skip else "open"
        model = (
            ("inside" if planner.plausible(cand) else "above") + " the limit by the model"
            if planner.use_model and planner.weights
            else "not judged by the model (no measured peak calibrates it)"
        )
        lines.append(
            f"{value(cand):.2f} {apart(cand, exported)}: "
            f"{'run' if candidate_key(cand) in ran else 'never run'}, {judged}, {model}, expected "
            f"{planner.expected_throughput(cand):.3g}/s, prior x{planner.prior(cand) / prior:.2f}"
        )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
