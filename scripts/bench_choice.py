#!/usr/bin/env python
"""The export's choice scored on the same searches: what each rule would have picked among them.

    python scripts/bench_choice.py [--landscapes 105] [--families trl,ppo,plain] [--seed 0,1,2] [--jobs 2]

The export is a search's last step (``choose_best`` after the confirmations), so a rule for it can be
scored exactly without searching again under each rule: every landscape's autotune search runs once,
as ``scripts/bench_search.py`` runs it (same recipe, seeds and decisions), and its final candidates
(``eligible``: the exportable trials with their short trials and confirmations) are kept beside their
values in truth. Each rule then picks among the same candidates:

- *short trial*: the fastest short trial, as if no confirmation were judged;
- *confirmation alone*: the best confirmation (the rule before the twenty-seventh pass);
- *both runs*: what autotune exports (:func:`autotune.study.ranking.judged`); checked against each
  search's own export, run by run (a difference is printed and the script exits 1);
- *perfect among the confirmed*: the best in truth of the confirmed candidates, which no rule beats
  without confirming others.

Rows: runs at 0.95 of the best possible, below 0.85, the mean score (capped at 1) and the 10th
percentile, as docs/benchmarks.md counts them; then how many picks each rule changed against *both
runs*, up and down. A rule worth trying is added to ``RULES``. The twenty-seventh pass of
docs/benchmarks-notes.md scored six seeds this way (about 25 minutes on 2 cores).

Two more tables say where the choice's limit lies (the twenty-eighth pass). *What more runs would buy*:
the K fastest short trials among the same candidates each run M more times, each run's throughput drawn
as the simulator draws a confirmation's (the configuration's value in truth times a lognormal of the
landscape's run factor and its steps' noise averaged over a confirmation's measured steps,
``Physics.measured_sigma``; transient crashes left out), the one with the best mean log throughput over
all its runs exported. A leader that dies in a long run (value 0) spends one run and is replaced by the
next, at most two times, as the confirmations' own cap does. Averaged over :data:`DRAWS` draws, with the
runs spent and their cost at the confirmations' measured price (the median, over the searches, of a
confirmation that held: its simulated hours, ``Run.held_hours``, in trial-equivalents as
``bench_search.cost`` counts them). Values are throughput in truth, as the first table's. *By how many
were good*: the exported rule's share at 0.95 by how many of the candidates were at 0.95 in truth."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import statistics
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_landscapes import build_landscape  # noqa: E402
from bench_search import policy_autotune, quiet, search_seed  # noqa: E402

import autotune.search.loop as loop  # noqa: E402
from autotune.sim.families import FAMILIES, landscape  # noqa: E402
from autotune.study.ranking import Confirmation, eligible, judged  # noqa: E402
from autotune.study.record import TrialRow  # noqa: E402
from autotune.trial.control import CONFIRM_FACTOR  # noqa: E402

TARGET = 0.95
FLOOR = 0.85

#: one candidate as the rules see it: its row, its confirmation (None if unconfirmed), its value in truth
Candidate = tuple[TrialRow, Confirmation | None, float]


def _held(cands: list[Candidate]) -> list[Candidate]:
    return [c for c in cands if c[1] is not None]


def _pick(cands: list[Candidate], key: Callable[[Candidate], float]) -> Candidate | None:
    """The best of the confirmed by ``key``; before any confirmation held, the fastest short trial."""
    held = _held(cands)
    if held:
        return max(held, key=key)
    return cands[0] if cands else None


RULES: dict[str, Callable[[list[Candidate]], Candidate | None]] = {
    "short trial": lambda cands: max(cands, key=lambda c: c[0].throughput or 0.0) if cands else None,
    "confirmation alone": lambda cands: _pick(cands, lambda c: c[1].throughput or 0.0),
    "both runs": lambda cands: _pick(cands, lambda c: judged(c[0], c[1])),
    "perfect among the confirmed": lambda cands: _pick(cands, lambda c: c[2]),
}
EXPORTED = "both runs"  # the rule autotune exports by, checked against each search's export
#: (leaders K, more runs M each) of *what more runs would buy*; (3, 1) is about what a search confirms
MORE_RUNS = [(3, 1), (3, 2), (3, 4), (5, 2), (5, 4), (8, 4), (15, 10)]
DRAWS = 20  # Monte Carlo draws of the more runs, per search
SPARE = 2  # leaders that die may be replaced this many times (confirm.py: --confirm + 2 runs at most)


def one(job: tuple[int, int, int]) -> dict[str, Any]:
    """One landscape's search; the value in truth (share of the best possible) each rule picks."""
    seed, index, trials = job
    quiet()
    d = landscape(index, seed)
    land = build_landscape(d, trials)
    seen: dict[str, Any] = {}
    choose = loop.choose_best

    def keep(rows_: list[TrialRow], recipe: Any, confirmed: Any = None, failed_long: Any = None) -> Any:
        seen["args"] = (rows_, recipe, confirmed or {}, failed_long)
        return choose(rows_, recipe, confirmed, failed_long)

    loop.choose_best = keep
    try:
        run = policy_autotune(land, search_seed(seed, index), trials)
    finally:
        loop.choose_best = choose
    best = max(land.best, 1e-9)
    picks: dict[str, float] = {}
    shorts: list[tuple[float, float]] = []  # every candidate's (short trial, value in truth)
    if "args" in seen:
        rows_, recipe, confirmed, failed = seen["args"]
        found, _ = eligible(rows_, recipe, confirmed, failed_long=failed)
        cands = [(r, confirmed.get(r.number), land.value(r.params) / best) for r in found]
        for name, rule in RULES.items():
            pick = rule(cands)
            picks[name] = pick[2] if pick else 0.0
        shorts = [(r.throughput or 0.0, value) for r, _, value in cands]
    else:
        picks = dict.fromkeys(RULES, 0.0)
    return {
        "run": f"{seed}/#{index}",
        "fits": land.best > 0,
        "exported": run.final / best if run.exported else 0.0,
        "picks": picks,
        "more": more_runs(
            shorts,
            best,
            d.physics.measured_sigma(land.recipe.measure_steps * CONFIRM_FACTOR),
            f"{seed}/{index}",
        ),
        "good": sum(value >= TARGET for _, value in shorts),
        "perfect": max([value for _, value in shorts] or [0.0]),
        # the confirmations that held, in trial-equivalents as bench_search.cost() counts a search
        "confirm_cost": sum(run.held_hours) * 3600 / land.recipe.gpus / land.trial_equivalent_s,
        "confirms": len(run.held_hours),
    }


def more_runs(
    shorts: list[tuple[float, float]], best: float, noise: float, seed: str
) -> dict[tuple[int, int], tuple[float, float]]:
    """For each (K, M) of :data:`MORE_RUNS`: the share of :data:`DRAWS` draws in which the K fastest
    short trials, each run M more times, export a configuration at 0.95, and the runs that took (a
    leader that dies in a long run spends one run and is replaced by the next, :data:`SPARE` times
    at most). Each (K, M) draws from its own generator, so one row does not move another."""
    leaders = sorted(shorts, key=lambda c: -c[0])
    out = {}
    for k, m in MORE_RUNS:
        rng = random.Random(f"{seed}/{k}/{m}")
        hits, spent = 0, 0
        for _ in range(DRAWS):
            top, alive, tried = None, 0, 0
            for short, value in leaders:
                if alive == k or tried == k + SPARE:
                    break
                tried += 1
                if value <= 0 or short <= 0:
                    spent += 1  # its longer run dies: seen, and passed over
                    continue
                alive += 1
                spent += m
                runs = [math.log(best * value) + rng.gauss(0.0, noise) for _ in range(m)]
                mean = statistics.fmean([math.log(short), *runs])
                if top is None or mean > top[0]:
                    top = (mean, value)
            hits += top is not None and top[1] >= TARGET
        out[(k, m)] = (hits / DRAWS, spent / DRAWS)
    return out


def print_limits(runs: list[dict[str, Any]]) -> None:
    """*What more runs would buy* and *by how many were good* (see the module's docstring)."""
    priced = [r["confirm_cost"] / r["confirms"] for r in runs if r["confirms"]]
    price = statistics.median(priced) if priced else float("nan")
    print(
        f"\n| what more runs would buy ({len(runs)} runs, {DRAWS} draws each) | >= {TARGET} "
        f"| runs a search (mean) | their cost (trial-equivalents, {price:.2f} a run) |"
    )
    print("|---|---|---|---|")
    for k, m in MORE_RUNS:
        hits = sum(r["more"][(k, m)][0] for r in runs)
        spent = statistics.fmean(r["more"][(k, m)][1] for r in runs) if runs else 0.0
        runs_each = f"{m} more run{'s' if m > 1 else ''} each"
        print(
            f"| the {k} fastest short trials, {runs_each} | {hits:.1f} | {spent:.2f} | {spent * price:.1f} |"
        )
    print(f"\n| candidates at {TARGET} in truth | runs | *{EXPORTED}* at {TARGET} |")
    print("|---|---|---|")
    for good in range(6):
        group = [r for r in runs if min(r["good"], 5) == good]
        hits = sum(r["picks"][EXPORTED] >= TARGET for r in group)
        print(f"| {good if good < 5 else '5 or more'} | {len(group)} | {hits} |")


def row(name: str, values: list[float], base: list[float]) -> str:
    n = len(values)
    tenth = sorted(values)[n // 10] if n else float("nan")
    mean = statistics.fmean(min(v, 1.0) for v in values) if n else float("nan")
    up = sum(v > b + 1e-12 for v, b in zip(values, base))
    down = sum(v < b - 1e-12 for v, b in zip(values, base))
    return (
        f"| {name} | {sum(v >= TARGET for v in values)} | {sum(v < FLOOR for v in values)} "
        f"| {mean:.4f} | {tenth:.3f} | {up} up, {down} down |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landscapes", default="105")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--seed", default="0,1,2")
    parser.add_argument("--trials", default="30")
    parser.add_argument("--jobs", default="2")
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    try:
        count, trials, jobs = int(args.landscapes), int(args.trials), int(args.jobs)
        seeds = [int(part) for part in args.seed.split(",") if part]
        if min(count, trials, jobs) < 1 or not seeds or min(seeds) < 0:
            raise ValueError(args.seed)
    except ValueError:
        print(
            "error: --landscapes, --trials and --jobs take whole numbers >= 1, --seed comma-separated "
            "whole numbers >= 0: --landscapes 105 --seed 0,1,2"
        )
        return 2
    if not families or set(families) - set(FAMILIES):
        print(f"error: --families takes some of {','.join(FAMILIES)}: --families trl,ppo")
        return 2
    work = [(s, i, trials) for s in seeds for i in range(count) if landscape(i, s).family in families]
    pool_context = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else nullcontext()
    with pool_context as pool:
        results = list(pool.imap(one, work) if pool is not None else map(one, work))
    runs = [r for r in results if r["fits"]]
    base = [r["picks"][EXPORTED] for r in runs]
    print(
        f"| the export's rule, same searches ({len(runs)} runs) | >= {TARGET} | < {FLOOR} | mean "
        f"| 10th pct | picks against *{EXPORTED}* |"
    )
    print("|---|---|---|---|---|---|")
    for name in RULES:
        print(row(name, [r["picks"][name] for r in runs], base))
    print(row("perfect among all of them (unconfirmed too)", [r["perfect"] for r in runs], base))
    print_limits(runs)
    apart = [r for r in runs if abs(r["picks"][EXPORTED] - r["exported"]) > 1e-9]
    for r in apart:
        picked = r["picks"][EXPORTED]
        print(f"{r['run']}: the search exported {r['exported']:.3f}, *{EXPORTED}* picks {picked:.3f}")
    return 1 if apart else 0


if __name__ == "__main__":
    raise SystemExit(main())
