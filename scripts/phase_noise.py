"""How much of a trainer's run-to-run luck its two phases share: the same configurations run again
and again (scripts/gpu_checks.sh's part ``phase`` on a GPU, or any runs directory whose studies
repeat a configuration), read from the ``generation_time`` and ``training_time`` each step logged.

    python scripts/phase_noise.py RUNS_DIR [--skip 2]      # prints a markdown report

Why it matters (docs/benchmarks-notes.md, thirty-fourth pass): a choice between two configurations
that generate alike (they differ only in how the batch is trained) could take each run's luck out
through its generation phase, but only as far as the generation's luck and the training's are one.
This reads, for every configuration run at least twice, each run's mean log phase times over its
steps after the first ``--skip`` (the search's warm-up): the spread of those means between runs,
the step-to-step spread within a run, and what of the first the second does not explain (the run
factor, which more measured steps cannot average away); and, pooled over configurations, how the
two phases' run effects move together: their correlation and the shared fraction
``2 sum(g t) / sum(g^2 + t^2)`` (1: one factor slows both phases alike; 0: none shared). It also
gives the generation time of each configuration against the others', which should be 1 where only
the training differs. Runs in different runs directories (calls made apart in time) are kept apart.
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
SHORT = {"generation_time": "generation", "training_time": "training", "step_time": "step"}


def _steps(metrics: Path, skip: int) -> list[dict[str, float]]:
    """The steps after the warm-up that logged every phase (a torn or odd line is left out)."""
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] <= skip:
            continue
        if all(isinstance(record.get(p), (int, float)) and record[p] > 0 for p in PHASES):
            steps.append(record)
    return steps


def _runs(root: Path, skip: int) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every trial under ROOT that logged two steps or more past the warm-up, by the runs directory
    that holds its study (runs made apart in time are not pooled: a drift between them is no run's
    luck) and its configuration."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for metrics in sorted(root.glob("**/trials/*/metrics.jsonl")):
        trial = metrics.parent
        try:
            params = json.loads((trial / "params.json").read_text())
        except (OSError, ValueError):
            continue
        steps = _steps(metrics, skip)
        if len(steps) < 2 or not isinstance(params, dict):
            continue
        session = str(trial.parents[2].relative_to(root))
        run: dict[str, Any] = {"trial": str(trial.relative_to(root)), "steps": len(steps)}
        for phase in PHASES:
            logs = [math.log(s[phase]) for s in steps]
            run[phase] = statistics.fmean(logs)
            run[phase + "_var"] = statistics.variance(logs)
        groups[(session, json.dumps(params, sort_keys=True))].append(run)
    return groups


def _labels(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Each group named by the knobs that differ between the configurations (all of them when one),
    after its runs directory when there are several."""
    params = {key: json.loads(key[1]) for key in keys}
    names = sorted({name for p in params.values() for name in p})
    varying = [n for n in names if len({str(p.get(n)) for p in params.values()}) > 1] or names
    sessions = len({key[0] for key in keys}) > 1
    return {
        key: (f"{key[0]}: " if sessions else "") + " ".join(f"{n}={params[key].get(n)}" for n in varying)
        for key in keys
    }


def spread(runs: list[dict[str, Any]], phase: str) -> dict[str, float]:
    """Between runs: the sd of the runs' mean log times. Within a run: the step-to-step sd pooled
    over the runs (weighted by their degrees of freedom, so a two-step run does not count as much as
    a seven-step one). The run factor: what of the between-run spread the steps' own share
    (pooled within-run variance over each run's steps) does not explain, 0 when it explains all."""
    means = [r[phase] for r in runs]
    within = sum((r["steps"] - 1) * r[phase + "_var"] for r in runs) / sum(r["steps"] - 1 for r in runs)
    between = statistics.variance(means) if len(runs) > 1 else float("nan")
    share = within * statistics.fmean(1 / r["steps"] for r in runs)
    return {
        "between": math.sqrt(between),
        "within": math.sqrt(within),
        "run": math.sqrt(max(0.0, between - share)) if len(runs) > 1 else float("nan"),
    }


def report(root: Path, skip: int) -> str:
    """The markdown report of every repeated configuration under ROOT (see the module docstring)."""
    found = _runs(root, skip)
    labels = _labels(list(found))
    lines = [f"# Phase noise: {root}", "", f"Steps after the first {skip} of each run; sd of log times.", ""]
    lines += [
        "| configuration | runs | steps | generation s | training s | step s | "
        "between runs: generation | training | step | "
        "step to step: generation | training | step | run factor: generation | training | step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    effects: list[tuple[float, float]] = []
    for key, runs in sorted(found.items(), key=lambda item: labels[item[0]]):
        mean = {p: statistics.fmean(r[p] for r in runs) for p in PHASES}
        sd = {p: spread(runs, p) for p in PHASES}
        counts = sorted(r["steps"] for r in runs)
        cells = [f"{math.exp(mean[p]):.3f}" for p in PHASES]
        cells += [f"{sd[p][part]:.3f}" for part in ("between", "within", "run") for p in PHASES]
        lines.append(
            f"| {labels[key]} | {len(runs)} | {counts[0]}-{counts[-1]} | " + " | ".join(cells) + " |"
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
    # generation time of configurations run side by side (the same runs directory), one against another
    keys = sorted(found, key=lambda key: labels[key])
    for a, b in zip(keys, keys[1:]):
        if a[0] == b[0]:
            ratio = math.exp(
                statistics.fmean(r["generation_time"] for r in found[a])
                - statistics.fmean(r["generation_time"] for r in found[b])
            )
            lines.append(f"Generation time, {labels[a]} / {labels[b]}: {ratio:.3f}")
    for key in keys:
        lines += ["", f"{labels[key]}:"]
        lines += [
            f"- {r['trial']}: {r['steps']} steps, generation {math.exp(r['generation_time']):.3f} s, "
            f"training {math.exp(r['training_time']):.3f} s"
            for r in found[key]
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
