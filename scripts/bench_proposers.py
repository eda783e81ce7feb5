#!/usr/bin/env python
"""What each proposer's launched trials were worth, by how far into the search they came.

    python scripts/bench_search.py --seed 0,1,2 --policies autotune --keep-trials --out /tmp/b.md
    python scripts/bench_proposers.py /tmp/b.json

The search proposes from the seeds, the local walk around the leaders, the grid's best open candidate
(the pool, every third proposal), a random valid candidate and TPE; a transient crash is run once
more (rerun). Which of them measures good configurations, and when, is what a change to the walk's
rhythm bets on; this reads it from a benchmark run kept with ``--keep-trials`` (each launched trial's
proposer, status and value in truth). Phases count launched trials in the order they ran. A trial
that ran counts at 0.95 when its value in truth is at least 0.95 of the best possible (as the
report's scores count), and safely when a long run of it also keeps the headroom free in truth (as
``measured_best`` counts); each proposer's row "all" sums its phases. Each run's export is traced
to the first trial that ran its configuration (status ok): the second table says how often each
proposer's exports reached 0.95.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_report import GOOD, autotune_runs

PHASE = 6  # launched trials a phase of the table spans
PHASES = 4  # the last one takes every later trial
UNTRACED = "(untraced)"  # an export no trial that ran had measured: a tracing failure, shown as such


def phase_name(i: int) -> str:
    if i == PHASES:
        return "all"
    first = i * PHASE + 1
    return f"{first}-{first + PHASE - 1}" if i < PHASES - 1 else f"{first}+"


def share(part: float, whole: float) -> str:
    return f"{part:g} ({part / whole:.0%})" if whole else "-"


def tables(rows: list[dict[str, Any]]) -> list[str]:
    """The two markdown tables: trials by family, proposer and phase; exports by proposer."""
    # (family, proposer, phase) -> [launched, ran, at 0.95, at 0.95 safely, sum of the ran values]
    cells: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0, 0, 0, 0, 0.0])
    # (family, proposer) -> [exports, at 0.95, at 0.95 safely]
    made: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in rows:
        first_by: dict[str, str] = {}
        for i, (_number, proposer, status, value, safe, params) in enumerate(r["trials"]):
            for phase in (min(i // PHASE, PHASES - 1), PHASES):  # its phase, and the whole search
                cell = cells[(r["family"], proposer or "?", phase)]
                cell[0] += 1
                if status == "ok":
                    cell[1] += 1
                    cell[2] += value >= GOOD
                    cell[3] += safe >= GOOD
                    cell[4] += value
            if status == "ok":
                first_by.setdefault(json.dumps(params, sort_keys=True), proposer or "?")
        if r["exported"]:
            by = first_by.get(json.dumps(r["exported"], sort_keys=True), UNTRACED)
            got = made[(r["family"], by)]
            got[0] += 1
            got[1] += r["final"] >= GOOD
            got[2] += r["final_safe"] >= GOOD
    lines = [
        "| family | proposer | trials | launched | ran | at 0.95 (of ran) | safely | mean value of ran |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (family, proposer, phase), (launched, ran, good, safe, total) in sorted(cells.items()):
        mean = f"{total / ran:.2f}" if ran else "-"
        cols = [family, proposer, phase_name(phase), launched, ran, share(good, ran), share(safe, ran), mean]
        lines.append("| " + " | ".join(str(c) for c in cols) + " |")
    lines += [
        "",
        "| family | the export first ran as | runs | at 0.95 | safely |",
        "|---|---|---|---|---|",
    ]
    for (family, by), (n, good, safe) in sorted(made.items()):
        lines.append(f"| {family} | {by} | {n} | {share(good, n)} | {share(safe, n)} |")
    return lines


def load(path: Path) -> list[dict[str, Any]]:
    """autotune's runs of a benchmark JSON kept with --keep-trials; ValueError says what is wrong."""
    ours = autotune_runs(path)
    if not ours or any("trials" not in r for r in ours):
        raise ValueError(
            f"{path}: no launched trials kept; run scripts/bench_search.py with --keep-trials "
            "(and --policies autotune) first"
        )
    for r in ours:
        ok = isinstance(r["trials"], list) and all(
            isinstance(t, list) and len(t) == 6 and isinstance(t[5], dict) for t in r["trials"]
        )
        if not ok or not {"family", "exported", "final", "final_safe"} <= set(r):
            raise ValueError(
                f"{path}: run {r.get('seed')}/#{r.get('landscape')} is not as bench_search.py writes it"
            )
    return [r for r in ours if not r.get("nothing_fits")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="the JSON beside a bench_search.py report")
    args = parser.parse_args()
    try:
        rows = load(args.json)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(f"{len(rows)} runs of autotune from {args.json}\n")
    print("\n".join(tables(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
