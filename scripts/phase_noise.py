"""How much of a trainer's run-to-run luck its two phases share: the same configurations run again
and again (scripts/gpu_checks.sh's part ``phase`` on a GPU, or any runs directory whose studies
repeat a configuration), read from the ``generation_time`` and ``training_time`` each step logged.

    python scripts/phase_noise.py RUNS_DIR [--skip 2]      # prints a markdown report

Why it matters (docs/benchmarks-notes.md, thirty-fourth pass): a choice between two configurations
that generate alike (they differ only in how the batch is trained) could take each run's luck out
through its generation phase, but only as far as the generation's luck and the training's are one.
This reads, for every configuration run at least twice, each run's mean log phase times over its
steps after the first ``--skip`` (the search's warm-up), the spread of those means between runs, and,
pooled over configurations, how the two phases' run effects move together: their correlation and
the shared fraction ``2 sum(g t) / sum(g^2 + t^2)`` (1: one factor slows both phases alike; 0: none
shared). It also gives the generation time of each configuration against the others', which should
be 1 where only the training differs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

PHASES = ("generation_time", "training_time", "step_time")


def _runs(root: Path, skip: int) -> dict[str, list[dict[str, Any]]]:
    """Every trial under ROOT that logged steps past the warm-up, by its configuration."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for metrics in sorted(root.glob("**/trials/*/metrics.jsonl")):
        trial = metrics.parent
        try:
            params = json.loads((trial / "params.json").read_text())
        except (OSError, ValueError):
            continue
        steps = []
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("step", 0) > skip and all(record.get(p, 0) > 0 for p in PHASES):
                steps.append(record)
        if len(steps) < 2:
            continue
        key = json.dumps(params, sort_keys=True)
        run = {"trial": str(trial.relative_to(root)), "steps": len(steps)}
        for phase in PHASES:
            logs = [math.log(s[phase]) for s in steps]
            run[phase] = statistics.fmean(logs)
            run[phase + "_step_sd"] = statistics.stdev(logs)
        groups[key].append(run)
    return groups


def _labels(keys: list[str]) -> dict[str, str]:
    """Each configuration named by the knobs that differ between them (all of them when one)."""
    params = {key: json.loads(key) for key in keys}
    names = sorted({name for p in params.values() for name in p})
    varying = [n for n in names if len({str(p.get(n)) for p in params.values()}) > 1] or names
    return {key: " ".join(f"{n}={params[key].get(n)}" for n in varying) for key in keys}


def report(root: Path, skip: int) -> str:
    found = _runs(root, skip)
    labels = _labels(list(found))
    groups = {labels[key]: runs for key, runs in found.items()}
    lines = [f"# Phase noise: {root}", "", f"Steps after the first {skip} of each run.", ""]
    lines += [
        "| configuration | runs | generation s | training s | step s | "
        "between runs, sd of log: generation | training | step | "
        "within a run, step to step: generation | training |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    effects: list[tuple[float, float]] = []
    means: dict[str, float] = {}
    for key, runs in sorted(groups.items()):
        mean = {p: statistics.fmean(r[p] for r in runs) for p in PHASES}
        means[key] = mean["generation_time"]
        spread = {p: statistics.stdev(r[p] for r in runs) if len(runs) > 1 else float("nan") for p in PHASES}
        within = {p: statistics.fmean(r[p + "_step_sd"] for r in runs) for p in PHASES}
        lines.append(
            f"| {key} | {len(runs)} | {math.exp(mean['generation_time']):.3f} | "
            f"{math.exp(mean['training_time']):.3f} | {math.exp(mean['step_time']):.3f} | "
            f"{spread['generation_time']:.3f} | {spread['training_time']:.3f} | {spread['step_time']:.3f} | "
            f"{within['generation_time']:.3f} | {within['training_time']:.3f} |"
        )
        if len(runs) > 1:
            effects += [
                (r["generation_time"] - mean["generation_time"], r["training_time"] - mean["training_time"])
                for r in runs
            ]
    lines.append("")
    if len(effects) >= 3:
        g = [e[0] for e in effects]
        t = [e[1] for e in effects]
        shared = 2 * sum(a * b for a, b in effects) / sum(a * a + b * b for a, b in effects)
        try:
            corr = f"{statistics.correlation(g, t):.2f}"
        except statistics.StatisticsError:
            corr = "undefined"
        lines += [
            f"Run effects pooled over {len(effects)} runs: correlation of generation and training {corr}, "
            f"shared fraction {shared:.2f}.",
            "",
        ]
    else:
        lines += ["Too few repeated runs to pool the run effects (three or more are needed).", ""]
    keys = sorted(means)
    for a, b in zip(keys, keys[1:]):
        lines.append(f"Generation time, {a} / {b}: {math.exp(means[a] - means[b]):.3f}")
    for key, runs in sorted(groups.items()):
        lines += ["", f"{key}:"]
        lines += [
            f"- {r['trial']}: {r['steps']} steps, generation {math.exp(r['generation_time']):.3f} s, "
            f"training {math.exp(r['training_time']):.3f} s"
            for r in runs
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of each run")
    args = parser.parse_args()
    print(report(args.runs, args.skip), end="")


if __name__ == "__main__":
    main()
