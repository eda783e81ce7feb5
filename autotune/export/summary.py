"""summary.md: what was chosen, why, what came close, and what the search spent."""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path
from typing import Any

from autotune import configs
from autotune.candidate.batch import completions_per_step
from autotune.candidate.constraints import space_of
from autotune.export.layout import BEST_FILES, COMMAND_SH, LAUNCH_SH, PARAMS_JSON, SWIFT_SH
from autotune.export.trl import fmt
from autotune.recipe import Recipe
from autotune.study.ranking import MIN_NOISE, Confirmation, eligible, judged, noise
from autotune.study.record import TrialRow
from autotune.trial.layout import GPU_CSV
from autotune.trial.outcome import Status

STATUS_ORDER = ("ok", "oom", "invalid", "crash", "timeout", "hang", "interrupted", "skipped")
RUNNERS_UP = 5


def _status_counts(rows: list[TrialRow]) -> tuple[Counter, Counter]:
    by_status = Counter(r.status for r in rows)
    oom_kinds = Counter(r.oom_kind or "unknown" for r in rows if r.status == "oom")
    return by_status, oom_kinds


def _differs(params: dict[str, Any], best: dict[str, Any]) -> str:
    keys = sorted(set(params) | set(best))
    changed = [f"{k}={params.get(k, '-')}" for k in keys if params.get(k) != best.get(k)]
    return ", ".join(changed) if changed else "(same parameters)"


LOW_UTIL_LISTED = 5


def utilization_section(best: TrialRow, rows: list[TrialRow], recipe: Recipe) -> list[str]:
    """The low-GPU-utilization diagnosis where people read the result.

    Most important when the exported configuration itself idled: it is the fastest that fits, yet
    the diagnosis says how it may go faster (write-up 004: ZeRO-3 offload swinging 0%..90%, fixed
    by hand). Other ok trials with a diagnosis follow, since their fix may beat the choice.
    """
    lines = ["", "## GPU utilization", ""]
    threshold = f"--min-util {recipe.min_util:.0%}"
    mean = f"mean {best.mean_gpu_util:.0%} over the measured steps" if best.mean_gpu_util is not None else ""
    if best.diagnosis:
        lines.append(
            f"**The chosen trial {best.number} left its GPUs idle** ({threshold}): {best.diagnosis}."
        )
        lines.append(
            "It is still the fastest configuration that fits; the change suggested may make it faster "
            "(try it with `--set NAME=VALUE` in a new search, or `autotune verify` after editing "
            f"{PARAMS_JSON})."
        )
    elif best.mean_gpu_util is not None:
        lines.append(f"The chosen trial {best.number} kept its GPUs busy: {mean} ({threshold}).")
    else:
        lines.append(
            f"The chosen trial {best.number} has no GPU utilization samples (no {GPU_CSV} was recorded)."
        )
    others = [r for r in rows if r.diagnosis and r.number != best.number and r.status == "ok"]
    others.sort(key=lambda r: -(r.throughput or 0))
    if others:
        lines += ["", "Other trials diagnosed with low GPU utilization:", ""]
        lines += [
            f"- trial {r.number} ({fmt(r.throughput)} completions/s): {r.diagnosis}"
            for r in others[:LOW_UTIL_LISTED]
        ]
        if len(others) > LOW_UTIL_LISTED:
            lines.append(f"- and {len(others) - LOW_UTIL_LISTED} more (autotune show lists them)")
    return lines


def summary_md(
    final: Path,
    best: TrialRow,
    recipe: Recipe,
    rows: list[TrialRow],
    notes: list[str],
    names: list[str],
    stopped: str | None = None,
    confirmed: dict[int, Confirmation] | None = None,
    failed_long: dict[str, str] | None = None,
) -> str:
    params = best.params
    confirmed = confirmed or {}
    exportable = {r.number for r in eligible(rows, recipe, confirmed, failed_long=failed_long)[0]}
    capacity = recipe.gpu_memory_gib
    lines = [f"# autotune: best GRPO configuration for {recipe.model}", ""]
    lines.append(
        f"{recipe.gpus} x {recipe.gpu_type} ({capacity:g} GiB each), prompt "
        f"{recipe.max_prompt_length} + completion {recipe.max_completion_length} tokens"
        + (f", global batch {recipe.global_batch}" if recipe.global_batch else "")
        + (f", LoRA rank {recipe.lora_rank}" if recipe.lora_rank else "")
        + "."
    )
    lines += _choice_section(best, recipe, params, capacity)
    lines += _runners_up_section(best, rows, params, confirmed, exportable)
    lines += utilization_section(best, rows, recipe)
    lines += _trials_section(rows, stopped)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += _reproduce_section(final, recipe, names)
    return "\n".join(lines) + "\n"


def _choice_section(best: TrialRow, recipe: Recipe, params: dict[str, Any], capacity: float) -> list[str]:
    """The chosen trial: speed, memory against the headroom, the batch, every parameter."""
    lines: list[str] = ["", "## Choice", ""]
    lines.append(f"Trial {best.number}: **{fmt(best.throughput)} completions/s**.")
    if best.peak_memory_gib is not None and capacity:
        used = best.peak_memory_gib / capacity
        lines.append(
            f"Peak memory {best.peak_memory_gib:.1f} GiB of {capacity:g} GiB capacity "
            f"({used:.0%} used, {capacity - best.peak_memory_gib:.1f} GiB free; required "
            f"headroom {recipe.headroom:.0%}, i.e. at most {capacity * (1 - recipe.headroom):.1f} GiB)."
        )
    else:
        lines.append(
            f"**Peak memory not measured** (the trainer logged none and NVML saw no GPU; capacity "
            f"{capacity:g} GiB, headroom {recipe.headroom:.0%}): headroom was judged by the calibrated "
            "memory model with its margin and by the out-of-memory trials beside it, not by a "
            "measurement; watch the first steps of the real run."
        )
    try:
        space = space_of(recipe)
        per_step = completions_per_step(
            configs.effective(params, recipe), recipe, space.batch if space is not None else None
        )
        if per_step is None:
            raise ValueError("the space does not say which parameters make the batch")
        lines.append(
            f"{per_step} completions per optimizer step on {recipe.dp_gpus(params)} data-parallel GPU(s)."
        )
    except (KeyError, TypeError, ValueError):
        pass
    lines += ["", "| parameter | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in params.items()]
    return lines


def _longer_run(row: TrialRow, c: Confirmation | None) -> str:
    """A trial's confirmation as the runners-up table shows it: both runs' figure when it held
    (what the choice compared, :func:`judged`), how it died when it did, where it was stopped below
    what it needed to win (``Confirmation.cut_below``), "-" when none was made."""
    if c is None:
        return "-"
    if c.status != Status.OK:
        return f"died ({c.ended})"
    if c.cut_below is not None:
        return c.cut_note
    return f"{fmt(c.throughput)} (both {judged(row, c):.3g})"


def _measured(row: TrialRow, confirmed: dict[int, Confirmation]) -> float:
    """The best figure of a trial's speed there is: both runs (:func:`judged`, what the choice
    compares) where its longer run held, else its short trial."""
    c = confirmed.get(row.number)
    if c is not None and c.held and c.throughput:
        return judged(row, c)
    return row.throughput or 0.0


def _runners_up_section(
    best: TrialRow,
    rows: list[TrialRow],
    params: dict[str, Any],
    confirmed: dict[int, Confirmation],
    exportable: set[int],
) -> list[str]:
    """The fastest other ok trials, their longer runs, how each differs from the choice, and which
    exportable ones are not measurably slower than it: with runs noisy by a few percent, a
    runner-up 2% behind is not slower, and a user who would rather launch one for its headroom or
    its settings should know that. Each is compared by the best figure there is of both (both runs
    where a longer run held, else the short trial), against the noise the search measured."""
    lines: list[str] = []
    ok = sorted(
        (
            r
            for r in rows
            if r.status == "ok" and r.throughput and r.number != best.number and r.launched and not r.pruned
        ),
        key=lambda r: -(r.throughput or 0),
    )[:RUNNERS_UP]
    lines += ["", "## Runners-up", ""]
    if not ok:
        return lines + ["No other trial finished ok."]
    lines += [
        "| trial | completions/s | vs best | longer run | peak GiB | differs from the choice |",
        "|---|---|---|---|---|---|",
    ]
    for r in ok:
        ratio = f"{r.throughput / best.throughput - 1:+.0%}" if best.throughput and r.throughput else "n/a"
        peak = "n/a" if r.peak_memory_gib is None else f"{r.peak_memory_gib:.1f}"
        lines.append(
            f"| {r.number} | {fmt(r.throughput)} | {ratio} | {_longer_run(r, confirmed.get(r.number))} "
            f"| {peak} | {_differs(r.params, params)} |"
        )
    spread = noise(rows, confirmed)
    bar = _measured(best, confirmed) * (1 - spread) - 1e-9  # what the noise cannot tell from the choice
    # a runner-up whose longer run was cut below its bar was settled as slower than the choice
    settled = {n for n, c in confirmed.items() if c.cut_below is not None}
    close = [
        r
        for r in ok
        if r.number in exportable and r.number not in settled and _measured(r, confirmed) >= bar > 0
    ]
    if any(c.held and c.throughput for c in confirmed.values()):
        how = f"the largest gap between a confirmed trial's short and longer runs, at least {MIN_NOISE:.0%}"
    else:
        how = "assumed: " + ("no longer run held to measure it" if confirmed else "no longer run was made")
    named = [f"{r.number}" + ("" if r.number in confirmed else " (unconfirmed)") for r in close]
    lines += [
        "",
        f"Run-to-run noise: {spread:.0%} ({how})."
        + (
            f" Not measurably slower than the choice: trial{'s' if len(close) > 1 else ''} "
            f"{', '.join(named)}, by both runs where a longer run held, else the short trial. Consider "
            f"{'them' if len(close) > 1 else 'it'} where headroom or other settings suit the production "
            "run better."
            if close
            else ""
        ),
    ]
    return lines


def _trials_section(rows: list[TrialRow], stopped: str | None) -> list[str]:
    """What the search spent: trials by status, repeats, pruned ones, wall time, why it stopped."""
    lines: list[str] = []
    by_status, oom_kinds = _status_counts(
        [r for r in rows if r.launched or r.status in ("invalid", "skipped")]
    )
    launched = sum(1 for r in rows if r.launched and r.status not in ("invalid", "skipped"))
    repeats = sum(1 for r in rows if not r.launched and r.status not in ("invalid", "skipped"))
    pruned = sum(1 for r in rows if r.pruned)
    lines += [
        "",
        "## Trials spent",
        "",
        f"- {len(rows)} trials, {launched} launched"
        + (f" ({pruned} pruned early as clearly slower)" if pruned else "")
        + (f", {repeats} repeats answered from earlier trials" if repeats else ""),
    ]
    for status in STATUS_ORDER:
        if status == "oom":
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(oom_kinds.items()))
            lines.append(f"- oom: {by_status['oom']}" + (f" ({kinds})" if kinds else ""))
        else:
            lines.append(f"- {status}: {by_status[status]}")
    for status in sorted(set(by_status) - set(STATUS_ORDER)):
        lines.append(f"- {status}: {by_status[status]}")
    wall = sum(r.wall_time_s or 0.0 for r in rows)
    if wall:
        lines.append(f"- wall time in trials: {wall / 3600:.2f} h")
    if stopped:
        lines.append(f"- {stopped}")
    return lines


def _reproduce_section(final: Path, recipe: Recipe, names: list[str]) -> list[str]:
    """How to verify and launch the choice, and what each written file is."""
    lines: list[str] = []
    study = recipe.name or final.parent.name
    runs_dir = final.parent.parent
    lines += [
        "",
        "## Reproduce / verify",
        "",
        "```",
        f"autotune verify {shlex.quote(study)} --runs-dir {shlex.quote(str(runs_dir))}",
    ]
    if COMMAND_SH in names:  # a template study: its own trainer's command is what it measured
        lines.append(f"bash {shlex.quote(str(final / COMMAND_SH))}")
    else:
        lines += [
            f"bash {shlex.quote(str(final / LAUNCH_SH))} --dataset_name DATA --reward_funcs REWARD "
            "--output_dir OUT",
            f"bash {shlex.quote(str(final / SWIFT_SH))} --dataset DATA --reward_funcs REWARD",
        ]
    lines += [
        "```",
        "",
        "## Files",
        "",
    ]
    lines += [f"- `{n}`: {BEST_FILES[n]}" for n in names if n in BEST_FILES]
    return lines
