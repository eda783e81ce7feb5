#!/usr/bin/env python
"""What each proposer's launched trials were worth, by how far into the search they came.

    python scripts/bench_search.py --seed 0,1,2 --policies autotune --keep-trials --out /tmp/b.md
    python scripts/bench_proposers.py /tmp/b.json

The search proposes from the seeds, the local walk around the leaders, the grid's best open candidate
(the pool, every third proposal) and TPE. Which of them measures good configurations, and when, is
what a change to the walk's rhythm bets on; this reads it from a benchmark run kept with
``--keep-trials`` (each launched trial's proposer, status and value in truth). A trial counts as good
when it runs at 0.95 of the best possible or better and a long run of it also keeps the headroom
free in truth (its safe value). Each run's exported configuration is traced to the trial that first
ran it, and the second table says how often each proposer's exports were good.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

GOOD = 0.95
PHASE = 6  # launched trials a phase of the table spans
PHASES = 4  # the last one takes every later trial


def phase_name(i: int) -> str:
    first = i * PHASE + 1
    return f"{first}-{first + PHASE - 1}" if i < PHASES - 1 else f"{first}+"


def tables(rows: list[dict[str, Any]]) -> list[str]:
    """The two markdown tables: trials by family, proposer and phase; exports by proposer."""
    # (family, proposer, phase) -> [launched, ran, good, sum of the ran trials' values]
    cells: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
    # (family, proposer) -> [exports, good exports]
    made: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        first_by: dict[str, str] = {}
        for i, (_number, proposer, status, value, safe, params) in enumerate(r["trials"]):
            cell = cells[(r["family"], proposer or "?", min(i // PHASE, PHASES - 1))]
            cell[0] += 1
            if status == "ok":
                cell[1] += 1
                cell[2] += safe >= GOOD
                cell[3] += value
            first_by.setdefault(json.dumps(params, sort_keys=True), proposer or "?")
        if r["exported"]:
            by = first_by.get(json.dumps(r["exported"], sort_keys=True), "(confirmation only)")
            made[(r["family"], by)][0] += 1
            made[(r["family"], by)][1] += r["final_safe"] >= GOOD
    lines = [
        "| family | proposer | trials | launched | ran | good (of ran) | mean value of ran |",
        "|---|---|---|---|---|---|---|",
    ]
    for (family, proposer, phase), (launched, ran, good, total) in sorted(cells.items()):
        share = f"{good / ran:.0%}" if ran else "-"
        mean = f"{total / ran:.2f}" if ran else "-"
        cols = [family, proposer, phase_name(phase), launched, ran, f"{good} ({share})", mean]
        lines.append("| " + " | ".join(str(c) for c in cols) + " |")
    lines += ["", "| family | the export first ran as | runs | good |", "|---|---|---|---|"]
    for (family, by), (n, good) in sorted(made.items()):
        lines.append(f"| {family} | {by} | {n} | {good} ({good / n:.0%}) |")
    return lines


def load(path: Path) -> list[dict[str, Any]]:
    """autotune's runs of a benchmark JSON kept with --keep-trials; ValueError says what is wrong."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a benchmark JSON ({exc})") from exc
    ours = [r for r in rows if isinstance(r, dict) and r.get("policy") == "autotune"]
    if not ours or any("trials" not in r for r in ours):
        raise ValueError(
            f"{path}: no launched trials kept; run scripts/bench_search.py with --keep-trials "
            "(and --policies autotune) first"
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
