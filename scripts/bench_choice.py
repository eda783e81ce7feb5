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
"""

from __future__ import annotations

import argparse
import multiprocessing
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
    if "args" in seen:
        rows_, recipe, confirmed, failed = seen["args"]
        found, _ = eligible(rows_, recipe, confirmed, failed_long=failed)
        cands = [(r, confirmed.get(r.number), land.value(r.params) / best) for r in found]
        for name, rule in RULES.items():
            pick = rule(cands)
            picks[name] = pick[2] if pick else 0.0
    else:
        picks = dict.fromkeys(RULES, 0.0)
    return {
        "run": f"{seed}/#{index}",
        "fits": land.best > 0,
        "exported": run.final / best if run.exported else 0.0,
        "picks": picks,
    }


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
    apart = [r for r in runs if abs(r["picks"][EXPORTED] - r["exported"]) > 1e-9]
    for r in apart:
        picked = r["picks"][EXPORTED]
        print(f"{r['run']}: the search exported {r['exported']:.3f}, *{EXPORTED}* picks {picked:.3f}")
    return 1 if apart else 0


if __name__ == "__main__":
    raise SystemExit(main())
