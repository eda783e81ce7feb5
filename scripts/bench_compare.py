#!/usr/bin/env python
"""Two benchmark runs of autotune compared run by run: a change told from the searches' luck.

    python scripts/bench_search.py --seed 0,1,2 --policies autotune --out /tmp/base.md
    python scripts/bench_search.py --seed 0,1,2 --policies autotune --luck 1 --out /tmp/luck.md
    python scripts/bench_compare.py /tmp/base.json /tmp/luck.json

Both runs search the same landscapes (the same ``--seed`` and ``--landscapes``), so their runs pair
up by seed and landscape. A change to the search moves some runs up and some down even where it
changes nothing that matters: a search's path is chaotic, and one trial measured otherwise sends the
rest of it elsewhere. ``--luck N`` shakes every path from its first trial (the same search, its
trials' noise, transient crashes and samplers' draws drawn anew); a change measured on the same draw
shakes only the paths it reaches, from where it first decides otherwise. This script says how far
apart two runs are: the report's headline for both, the share at 0.95 by seed and family with the
mean change of the score (capped at 1, as a run above the best possible gains nothing), and the runs
that crossed 0.95 each way with an exact two-sided sign test over them (McNemar's test: under no real
difference a run that crosses is as likely to cross up as down). The test is the row of all runs;
the seeds' and families' rows are there to read, not to test (ten p-values, one of them small by
chance now and then). A p-value well above 0.05 is a difference the benchmark cannot tell from luck.
Two runs of different draws differ by luck alone by about 1.7 points of the share at 0.95 on six
seeds (one standard deviation; the thirtieth pass in docs/benchmarks-notes.md). Where either file
holds several draws (``--luck 0,1,2``) the runs pair up by seed, landscape and draw, and the draws are
counted apart too: a change judged on three draws at once. A run made with ``--exact`` (every trial's
throughput measured without noise) pairs with the same run made without it: the runs that cross 0.95
up are misses the noise made; those that still miss are the search's own (or, at the edge, a run's
memory luck, which ``--exact`` leaves as the truth has it). A path that sees other measurements goes
elsewhere, so a few runs cross down too.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import GOOD, autotune_runs, metrics  # noqa: E402

from autotune.sim.families import FAMILIES  # noqa: E402

WHOLE = ("seed", "landscape")  # what names a run
NUMBERS = ("best_possible", "final", "final_safe", "fitting", "cost", "at20", "ooms", "launched")

Key = tuple[int, ...]  # (seed, landscape), or (seed, landscape, luck) where a file holds several draws


def sign_test(up: int, down: int) -> float:
    """Exact two-sided p-value of ``up`` against ``down`` when each is as likely as the other."""
    n = up + down
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(up, down) + 1)) / 2**n
    return min(1.0, 2 * tail)


def load(path: Path) -> list[dict[str, Any]]:
    """autotune's runs of a benchmark JSON, checked; ValueError says what is wrong."""
    ours = autotune_runs(path)
    if not ours:
        raise ValueError(
            f"{path}: no run of autotune; run scripts/bench_search.py with autotune among --policies"
        )
    for r in ours:
        whole = all(type(r.get(k)) is int and r[k] >= 0 for k in WHOLE) and type(r.get("luck", 0)) is int
        numbers = all(type(r.get(k)) in (int, float) and math.isfinite(r[k]) for k in NUMBERS)
        if not (whole and numbers and isinstance(r.get("family"), str)):
            name = f"{r.get('seed')}/#{r.get('landscape')}"
            raise ValueError(f"{path}: run {name} is not as scripts/bench_search.py writes it")
    return ours


def by_run(path: Path, ours: list[dict[str, Any]], draws: bool) -> dict[Key, dict[str, Any]]:
    """The runs by (seed, landscape), and by their draw too when ``draws``; ValueError on a run twice."""
    runs = {(r["seed"], r["landscape"], *([r.get("luck", 0)] if draws else [])): r for r in ours}
    if len(runs) != len(ours):
        raise ValueError(f"{path}: a seed/landscape appears twice in one draw: one benchmark run per file")
    return runs


def name(key: Key) -> str:
    return f"{key[0]}/#{key[1]}" + (f" luck {key[2]}" if len(key) > 2 else "")


def label(path: Path, runs: list[dict[str, Any]]) -> str:
    """A file as the user named it, with the luck its compared runs were drawn with, whether they were
    measured exactly (``bench_search.py --exact``) and what the truth told them (``--oracle``)."""
    lucks = sorted({r.get("luck", 0) for r in runs})
    exact = ", measured exactly" if any(r.get("exact") for r in runs) else ""
    oracles = sorted({r["oracle"] for r in runs if r.get("oracle")})
    told = f", told the truth's {' and '.join(oracles)}" if oracles else ""
    return f"{path} (luck {', '.join(map(str, lucks))}{exact}{told})"


def p_value(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def headline(name: str, rows: list[dict[str, Any]]) -> str:
    m = metrics(rows)
    good, safe = (sum(r[k] >= GOOD for r in rows) for k in ("final", "final_safe"))
    return (
        f"| {name} | {m['runs']} | {good} ({m['share95']:.1%}) | {safe} "
        f"| {m['below85']} | {m['worst']:.2f} | {m['empty']} | {m['cost']:.1f} | {m['stretch']:.0%} |"
    )


def compare(
    base: dict[Key, dict[str, Any]], other: dict[Key, dict[str, Any]], names: tuple[str, str]
) -> list[str]:
    """The markdown the script prints for the runs both hold."""
    keys = sorted(set(base) & set(other))
    lines = [
        "| | runs | >= 0.95 | counted safely | < 0.85 | worst | empty export | median cost | 0.98 @20 |",
        "|---|---|---|---|---|---|---|---|---|",
        headline(names[0], [base[k] for k in keys]),
        headline(names[1], [other[k] for k in keys]),
        "",
        "| group | runs | >= 0.95: first -> second | crossed up | crossed down | mean change | sign test p |",
        "|---|---|---|---|---|---|---|",
    ]
    order = [f for f in FAMILIES if any(base[k]["family"] == f for k in keys)]
    order += sorted({base[k]["family"] for k in keys} - set(order))
    groups = [(f"seed {s}", lambda k, s=s: k[0] == s) for s in sorted({k[0] for k in keys})]
    groups += [(f, lambda k, f=f: base[k]["family"] == f) for f in order]
    lucks = sorted({k[2] for k in keys if len(k) > 2})
    groups += [(f"luck {n}", lambda k, n=n: k[2] == n) for n in lucks if len(lucks) > 1]
    groups.append(("all", lambda k: True))
    crossed: list[tuple[Key, float, float]] = []
    for group, member in groups:
        mine = [k for k in keys if member(k)]
        before = sum(base[k]["final"] >= GOOD for k in mine)
        after = sum(other[k]["final"] >= GOOD for k in mine)
        moved = [k for k in mine if (base[k]["final"] >= GOOD) != (other[k]["final"] >= GOOD)]
        up = sum(other[k]["final"] >= GOOD for k in moved)
        change = sum(min(other[k]["final"], 1.0) - min(base[k]["final"], 1.0) for k in mine) / len(mine)
        change = round(change, 4) + 0.0  # never "-0.0000"
        lines.append(
            f"| {group} | {len(mine)} | {before} -> {after} | {up} | {len(moved) - up} | {change:+.4f} "
            f"| {p_value(sign_test(up, len(moved) - up))} |"
        )
        if group == "all":
            crossed = [(k, base[k]["final"], other[k]["final"]) for k in moved]
    lines += ["", "Runs that crossed 0.95:" if crossed else "No run crossed 0.95."]
    lines += [f"- {name(k)} {base[k]['family']}: {a:.3f} -> {b:.3f}" for k, a, b in crossed]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a JSON beside a bench_search.py report (the base)")
    parser.add_argument("second", type=Path, help="another, of the same seeds and landscapes")
    args = parser.parse_args()
    try:
        first, second = load(args.first), load(args.second)
        # one draw a file: its runs pair by seed and landscape, whatever the draw (luck 1 against 2);
        # several: by the draw too
        draws = max(len({r.get("luck", 0) for r in rows}) for rows in (first, second)) > 1
        base, other = by_run(args.first, first, draws), by_run(args.second, second, draws)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    both = set(base) & set(other)
    if not both:
        print(
            f"error: {args.first} and {args.second} share no run: benchmark the same --seed and --landscapes "
            "(and, where a file holds several draws, the same --luck)"
        )
        return 2
    changed = sorted(k for k in both if not math.isclose(base[k]["best_possible"], other[k]["best_possible"]))
    if changed:
        print(
            f"error: {name(changed[0])} has another best possible in each file: the landscapes changed "
            "between the two runs; compare runs of the same simulator"
        )
        return 2
    apart = len(set(base) ^ set(other))
    print(
        f"{len(both)} runs of autotune in both files"
        + (f" ({apart} in only one, left out)" if apart else "")
        + "\n"
    )
    shared = sorted(both)
    names = (label(args.first, [base[k] for k in shared]), label(args.second, [other[k] for k in shared]))
    print("\n".join(compare(base, other, names)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
