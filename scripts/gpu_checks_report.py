"""The report of a GPU run (scripts/gpu_checks.sh, scripts/gpu_validate.sh): every study under
RUNS_DIR, trial by trial and production-run attempt by attempt, from the files autotune wrote
(outcome.json, params.json, metrics.jsonl, run/).

    python scripts/gpu_checks_report.py RUNS_DIR        # writes RUNS_DIR/report.md and prints it

Predicted GiB is the memory model's figure the search recorded for the trial; "torch reserved" is
``torch.cuda.max_memory_reserved`` the worker logged, "peak" the larger of that and the device's
used memory (``mem_get_info``), which is what autotune judges a trial by.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "" if value is None else format(value, spec)


def _reserved(folder: Path) -> float | None:
    """The largest ``torch_peak_reserved_gib`` of the folder's metrics.jsonl."""
    best = None
    path = folder / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                value = json.loads(line).get("torch_peak_reserved_gib")
            except ValueError:
                continue
            if isinstance(value, (int, float)):
                best = value if best is None else max(best, value)
    return best


def _params(folder: Path) -> str:
    params = _json(folder / "params.json")
    return " ".join(f"{k}={v}" for k, v in params.items() if k != "use_vllm")


def _row(label: str, folder: Path) -> str:
    o = _json(folder / "outcome.json")
    util = o.get("mean_gpu_util")
    error = (o.get("error_line") or "").replace("|", "/")[:180]
    return (
        f"| {label} | {_params(folder)} | {o.get('status', 'no outcome')} | {o.get('oom_kind') or ''} | "
        f"{_fmt(o.get('throughput'), '.2f')} | {_fmt(o.get('peak_memory_gib'))} | "
        f"{_fmt(_reserved(folder))} | "
        f"{_fmt(o.get('predicted_gib'))} | {'' if util is None else f'{util:.0%}'} | "
        f"{_fmt(o.get('wall_time_s'), '.0f')} | {error} |"
    )


def report(runs: Path) -> str:
    lines = ["# GPU run", ""]
    for name in ("nvidia-smi.txt", "versions.txt", "doctor.txt", "estimate.txt", "steps.txt"):
        if (runs / name).exists():
            lines += ["```", (runs / name).read_text().strip(), "```", ""]
    lines += [
        "| study / trial | params | status | kind | completions/s | peak GiB | torch reserved GiB | "
        "predicted GiB | GPU util | wall s | error line |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for study in sorted(p.parent for p in runs.glob("*/study.db")):
        trials = sorted((study / "trials").glob("*/outcome.json"), key=lambda p: int(p.parent.name))
        lines += [_row(f"{study.name} {t.parent.name}", t.parent) for t in trials]
        attempts = sorted((study / "run" / "attempts").glob("*/"), key=lambda p: int(p.name))
        lines += [_row(f"{study.name} run attempt {a.name}", a) for a in attempts]
    for study in sorted(p.parent for p in runs.glob("*/study.db")):
        attempts = sorted((study / "run" / "attempts").glob("*/"), key=lambda p: int(p.name))
        for attempt in attempts:
            resumed = attempt / "resumed_from.txt"
            checkpoints = sorted(p.name for p in attempt.glob("checkpoint-*"))
            lines.append(
                f"- {study.name} run attempt {attempt.name}: checkpoints {', '.join(checkpoints) or 'none'}"
                + (f"; resumed from {resumed.read_text().strip()}" if resumed.exists() else "")
            )
    # what the two scripts' commands printed (gpu_checks.sh's production run, gpu_validate.sh's
    # search, show and verify), last lines only
    for name in (
        "run-1.txt",
        "run-2.txt",
        "run-show.txt",
        "cpu_adam.txt",
        "search.txt",
        "show.txt",
        "verify.txt",
    ):
        path = runs / name
        if path.exists():
            tail = path.read_text().strip().splitlines()[-25:]
            lines += ["", f"## {name}", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    runs = Path(sys.argv[1])
    text = report(runs)
    (runs / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
