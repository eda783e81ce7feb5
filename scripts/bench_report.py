"""docs/benchmarks.md from the benchmark's rows: the distribution, not the mean (bench_search.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

GOOD = 0.95  # issue 19's share of the best possible: a run at or above it counts

TARGETS = (
    "Targets (issue 19), within 30 launched trials: >= 0.95 of the best possible in at least 95% of runs, "
    "no run below 0.85, no run that exports nothing where something fits, median whole-search cost <= 15 "
    "trial-equivalents; stretch: >= 0.98 within 20 trials in 80% of runs."
)


def p10(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.1 * (len(ordered) - 1))] if ordered else 0.0


def autotune_runs(path: Path) -> list[dict[str, Any]]:
    """autotune's rows of the JSON that scripts/bench_search.py writes beside its report (the scripts
    that read a benchmark run back start here); ValueError says what is wrong."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a benchmark JSON ({exc})") from exc
    if not isinstance(rows, list):
        raise ValueError(f"{path}: not a benchmark JSON (a list of runs)")
    return [r for r in rows if isinstance(r, dict) and r.get("policy") == "autotune"]


def metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    finals = [r["final"] for r in rows]
    return {
        "runs": len(rows),
        "share95": sum(f >= GOOD for f in finals) / len(rows),
        "p10": p10(finals),
        "worst": min(finals),
        "below85": sum(f < 0.85 for f in finals),
        "empty": sum(1 for r in rows if r["final"] == 0 and r["fitting"] > 0),
        "inside": sum(1 for r in rows if r["final"] > 0 and r.get("final_safe", r["final"]) == 0),
        "cost": statistics.median(r["cost"] for r in rows),
        "stretch": sum(r["at20"] >= 0.98 for r in rows) / len(rows),
        "ooms": statistics.fmean(r["ooms"] for r in rows),
        "launched": statistics.fmean(r["launched"] for r in rows),
    }


def run_name(row: dict[str, Any], seeds: int, draws: int = 1) -> str:
    """A run's name in the tables: ``#29``, or ``1/#29`` (seed 1's landscape 29) when several seeds
    are reported together, with ``luck 2`` when several draws of luck are (``bench_inspect.py 1/29
    --luck 2`` replays it)."""
    name = f"{row.get('seed', 0)}/#{row['landscape']}" if seeds > 1 or draws > 1 else f"#{row['landscape']}"
    return f"{name} luck {row.get('luck', 0)}" if draws > 1 else name


def table(groups: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    lines = [
        "| | runs | >= 0.95 | 10th pct | worst | < 0.85 | empty export | inside headroom | median cost "
        "| 0.98 @20 | OOMs | launched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in groups:
        if not rows:
            continue
        m = metrics(rows)
        lines.append(
            f"| {name} | {m['runs']} | {m['share95']:.0%} | {m['p10']:.2f} | {m['worst']:.2f} "
            f"| {m['below85']} | {m['empty']} | {m['inside']} | {m['cost']:.1f} | {m['stretch']:.0%} "
            f"| {m['ooms']:.1f} "
            f"| {m['launched']:.0f} |"
        )
    return lines


def by_family(ours: list[dict[str, Any]], families: list[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    """All runs, then each family's: the rows of every autotune table."""
    return [("all", ours), *[(f, [r for r in ours if r["family"] == f]) for f in families]]


NOISE_BANDS = ((0.0, 0.04, "2-4%"), (0.04, 0.06, "4-6%"), (0.06, 0.08, "6-8%"), (0.08, 1.0, "8-10%"))


def by_noise(ours: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The runs by their landscape's drawn run-to-run noise: how much of a miss the noise explains."""
    drawn = [(r, r.get("drawn", {}).get("noise")) for r in ours]
    return [
        (f"noise {name}", [r for r, n in drawn if n is not None and low <= n < high])
        for low, high, name in NOISE_BANDS
    ]


def miss_rows(groups: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    lines = [
        "| | runs | >= 0.95 | below 0.95 | of them: measured one, chose another | never measured one |",
        "|---|---|---|---|---|---|",
    ]
    for name, group in groups:
        if not group:
            continue
        miss = [r for r in group if r["final"] < GOOD]
        chose = sum(r.get("measured_best", 0.0) >= GOOD for r in miss)
        share = metrics(group)["share95"]
        lines.append(f"| {name} | {len(group)} | {share:.0%} | {len(miss)} | {chose} | {len(miss) - chose} |")
    return lines


def misses(ours: list[dict[str, Any]], families: list[str]) -> list[str]:
    """Why autotune's runs below 0.95 miss it: the search never ran a configuration at 0.95 of the best
    possible (*measured* is the best that any launched trial ran), or it ran one and the choice among
    the measured (short trials' noise, a confirmation inside the headroom) exported another; by family,
    then by the landscape's drawn noise, with which the misses rise."""
    return [
        "## Why runs miss 0.95",
        "",
        "*measured*: the best possible value of the best configuration any launched trial of the run ran "
        "(kept the headroom in truth). Below 0.95 with *measured* >= 0.95, the search had run one and the "
        "choice among what it measured exported another (noise in the short trials and confirmations, a "
        "confirmation inside the headroom); below 0.95 with *measured* < 0.95, the search never reached one.",
        "",
        *miss_rows(by_family(ours, families)),
        "",
        "By the landscape's drawn run-to-run noise (a lognormal factor on each run's speed, 2-10%): with one "
        "or two runs a candidate, the noise decides between configurations a few percent apart.",
        "",
        *miss_rows(by_noise(ours)),
        "",
    ]


def proposers(ours: list[dict[str, Any]], families: list[str]) -> list[str]:
    """Launched search trials by the proposer that made them (seeds, the local walk, the grid's best
    open candidate, TPE, a transient crash's re-run), and the share that ran out of memory: where a
    family's trials go."""
    kinds = sorted({k for r in ours for k in r.get("by_proposer", {})})
    lines = [
        "## Launched trials by proposer",
        "",
        "Per family, launched search trials (confirmations apart) by the proposer that made them, with the "
        "share that ran out of memory (autotune/search/policy.py names the proposers; rerun: a transient "
        "crash run once more).",
        "",
        "| | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for name, group in by_family(ours, families):
        cells = []
        for k in kinds:
            counts = [r.get("by_proposer", {}).get(k, {}) for r in group]
            n = sum(sum(c.values()) for c in counts)
            oom = sum(c.get("oom", 0) for c in counts)
            cells.append(f"{n} ({oom / n:.0%} OOM)" if n else "0")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def draws_section(ours: list[dict[str, Any]], families: list[str]) -> list[str]:
    """The same searches under each draw of their luck (``--luck 0,1,2``), and how many landscapes
    reach 0.95 in every draw, in some and in none: a share measured on one draw is a sample of one,
    and a landscape that reaches 0.95 in some draws only is a coin the draw decides, where one that
    never does is the search's own miss (docs/benchmarks-notes.md, thirtieth pass)."""
    lucks = sorted({r.get("luck", 0) for r in ours})
    hits: dict[tuple[Any, ...], list[bool]] = {}
    for r in ours:
        hits.setdefault((r.get("seed", 0), r["landscape"], r["family"]), []).append(r["final"] >= GOOD)
    lines = [
        "## The same searches, their luck drawn anew",
        "",
        "Each draw runs the same searches on the same landscapes with their trials' run-to-run noise, "
        "transient crashes and the samplers' draws drawn anew (`--luck`; 0 is the benchmark's own draw, "
        "the one earlier reports gave alone). The tables above and below pool every draw; the baselines "
        "run under the same draws.",
        "",
        *table([(f"luck {n}", [r for r in ours if r.get("luck", 0) == n]) for n in lucks]),
        "",
        f"Landscapes by the draws (of {len(lucks)}) in which autotune reached 0.95:",
        "",
        "| | landscapes | every draw | some | none |",
        "|---|---|---|---|---|",
    ]
    for name in ["all", *families]:
        mine = [h for (_, _, f), h in hits.items() if name in ("all", f)]
        every, none = sum(all(h) for h in mine), sum(not any(h) for h in mine)
        if mine:
            lines.append(f"| {name} | {len(mine)} | {every} | {len(mine) - every - none} | {none} |")
    return [*lines, ""]


FAMILIES_TEXT = (
    "Landscapes of several independent families (autotune/sim/families.py): `trl` is the GRPO simulator "
    "(TRL's knob names; tight and roomy hardware, QLoRA 4-bit and a vision-language model with 768 "
    "image tokens), `ppo` a four-model PPO trainer and `plain` a micro-batch trainer with knobs that do "
    "nothing and, on about half its landscapes, no memory in its logs, both in their own knob names "
    "through template spaces."
)
HELD_OUT_TEXT = (
    "Landscapes of the held-out family `verl` (autotune/sim/verl.py): a verl-style GRPO trainer, an FSDP "
    "actor beside a colocated vLLM rollout, in verl's own knob names through a template space "
    "(autotune/sim/spaces/verl.yaml), on four machines from 4 x 24 GB to 8 x 80 GB with drawn prompt "
    "and completion lengths; on about a fifth of them no memory in its logs. It was written after the "
    "search had been shaped on the other three families and measured before any change; six changes "
    "since were read off its runs (the walk's leanest step after three OOMs with nothing fit, "
    "vLLM's share read under verl's name for it, the grid's best open candidate giving up turns "
    "while its trials run out of memory, the walk's ties going to the neighbour that spends memory "
    "where peaks are measured, the pool's ties to each integer knob's larger value, and the walk's "
    "last ties up an integer knob of unknown effect, its rollout's TP: "
    "docs/benchmarks-notes.md, thirty-eighth to forty-fifth passes), "
    "so its figures are held out from every other."
)
NEMO_TEXT = (
    "Landscapes of the held-out family `nemo` (autotune/sim/nemo.py): a NeMo-RL-style GRPO trainer, a "
    "Megatron-Core policy split by tensor and pipeline parallelism (distributed optimizer, optional CPU "
    "offload of Adam, selective or full recomputation) beside a colocated vLLM that it hands the card "
    "to each rollout, in NeMo-RL's own knob names through a template space "
    "(autotune/sim/spaces/nemo.yaml), on four machines from 4 x 24 GB to 8 x 80 GB with drawn prompt "
    "and completion lengths; on about a fifth of them no memory in its logs. The space states the two "
    "layout rules NeMo-RL's docs give (TP x PP divides the GPUs, sequence parallelism needs TP > 1); a "
    "layout whose TP does not divide the model's heads is refused at start-up. It was written by a "
    "helper that never read the search, after the search had been shaped on the three report families "
    "and after `verl`, and measured before any change; the changes since were read off its runs "
    "(docs/benchmarks-notes.md, thirty-ninth, fortieth, forty-second, forty-third, forty-sixth and "
    "forty-seventh passes, the last two a value the trainer refused by name not launched again in other "
    "settings and each value of a switch nothing describes, its recomputation's granularity, run before "
    "the search settles); the forty-fourth's and forty-fifth's changes, the pool's ties and the walk's "
    "last ones, were read off verl's, and the forty-fifth's moves none of its runs."
)
HELD_OUT_TEXTS = {"verl": HELD_OUT_TEXT, "nemo": NEMO_TEXT}  # a held-out family's runs, reported alone


EXACT_TEXT = (
    "**Measured exactly** (`--exact`): here every trial and confirmation ran without that noise and without "
    "transient crashes, on the same landscapes with the same best possible: what the search reaches when "
    "the throughputs it measures are the truth (a run's memory luck, the allocator's creep and "
    "fragmentation, stays as the truth has it). `python scripts/bench_compare.py` against the same run "
    "without `--exact` tells how much of each miss is the noise's and how much the search's."
)

ORACLE_TEXT = (
    "**Told the truth** (`--oracle {told}`): here autotune's planner knew what the landscape's truth says "
    "(memory: it skipped every configuration a long run of which dies or peaks inside the headroom; "
    "prior: it ranked by each configuration's true throughput where the speed prior stands), on the "
    "same landscapes with the same best possible: a bound on what knowing that side better could buy, "
    "not the search as it runs. `python scripts/bench_compare.py` against the same run without "
    "`--oracle` tells how far it is."
)


def write_report(rows: list[dict[str, Any]], args: Any, seconds: float) -> list[str]:
    ours = [r for r in rows if r["policy"] == "autotune"]
    families = sorted({r["family"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    seeds = sorted({r.get("seed", 0) for r in rows})
    lucks = sorted({r.get("luck", 0) for r in rows})
    draws = len(lucks)
    exact = any(r.get("exact") for r in rows)
    told = next((r["oracle"] for r in rows if r.get("oracle")), "")
    # an exact or told run is kept out of docs/ (bench_search.py refuses it there): its --out as given;
    # a held-out family's report is not the default file, which the command without --out would overwrite
    out = str(args.out) if exact or told else f"docs/{Path(args.out).name}"
    cmd = (
        f"python scripts/bench_search.py --landscapes {args.landscapes} --families {args.families} "
        f"--trials {args.trials} --seed {args.seed} --jobs {args.jobs}"
        + (f" --luck {','.join(map(str, lucks))}" if lucks != [0] else "")
        + (" --exact" if exact else "")
        + (f" --oracle {told}" if told else "")
        + (f" --out {out}" if out != "docs/benchmarks.md" else "")
    )
    per_seed = (
        [
            "Each seed draws its own landscapes and searches; a run is named seed/#landscape below.",
            "",
            *table([(f"seed {s}", [r for r in ours if r.get("seed", 0) == s]) for s in seeds]),
            "",
        ]
        if len(seeds) > 1
        else []
    )
    lines = [
        "# Search benchmark",
        "",
        f"Produced by `{cmd}` ({seconds / 60:.1f} min on this machine); machine-readable: "
        f"docs/{Path(args.out).with_suffix('.json').name}.",
        "",
        (HELD_OUT_TEXTS.get(families[0], FAMILIES_TEXT) if len(families) == 1 else FAMILIES_TEXT)
        + " Each landscape draws its physics: every memory and speed term x 0.7-1.4, "
        "vLLM's thresholds moved, 2-10% step-time noise from run to run and a third to three times that "
        "from step to step, 0-5% of trials dying of an NCCL watchdog timeout.",
        "",
        *([EXACT_TEXT, ""] if exact else []),
        *([ORACLE_TEXT.format(told=told), ""] if told else []),
        "*best possible*: the fastest configuration in the whole valid grid that survives long runs (warm-up "
        "+ 3 x measured steps, three truth seeds, throughput averaged, without run-to-run noise or transient "
        "crashes: the expected throughput) with the headroom free. A run scores "
        "the averaged long-run throughput of what it exported (0 if that dies in a long run) over the best "
        "possible. *cost*: every trial and confirmation, in trial-equivalents (loading plus 7 steps of the "
        "best configuration). *0.98 @20*: share of runs whose pick after 20 launched trials is within 2%. "
        "*empty export*: runs that export nothing (or something that dies) although a configuration fits. "
        "*inside headroom*: runs whose export survives long runs but, in truth, peaks within the headroom "
        "(a trainer that logs no memory, or a long run's peak above the short runs' by the allocator's "
        "creep): scored by its throughput all the same, since nothing the search measured showed it. "
        "Every baseline confirms its pick the way autotune does and is charged for it.",
        "",
        TARGETS,
        "",
        "## autotune",
        "",
        *table(by_family(ours, families)),
        "",
        *per_seed,
        *(draws_section(ours, families) if draws > 1 else []),
        "## Baselines beside it (all families)",
        "",
        *table([(p, [r for r in rows if r["policy"] == p]) for p in policies]),
        "",
    ]
    for f in families:
        lines += [
            f"### {f}",
            "",
            *table([(p, [r for r in rows if r["policy"] == p and r["family"] == f]) for p in policies]),
            "",
        ]
    lines += misses(ours, families)
    lines += proposers(ours, families)
    worst = sorted(ours, key=lambda r: (r["final"], -r["cost"]))[:10]
    lines += [
        "## The worst autotune runs",
        "",
        "| landscape | family | case | final | measured | @30 | cost | launched | OOMs | crashes | stopped "
        "| exported |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in worst:
        exported = ", ".join(f"{k}={v}" for k, v in sorted((r["exported"] or {}).items())) or "nothing"
        lines.append(
            f"| {run_name(r, len(seeds), draws)} | {r['family']} | {r['case']} | {r['final']:.2f} | "
            f"{r.get('measured_best', 0.0):.2f} | {r['at30']:.2f} | "
            f"{r['cost']:.1f} | {r['launched']} | {r['ooms']} | {r['crashes']} | {r['stopped']} "
            f"| {exported} |"
        )
    lines += [
        "",
        "Their drawn physics and, for the worst three, every launched trial (true value in brackets, "
        "and whether its long runs reach it only inside the headroom):",
        "",
    ]
    for i, r in enumerate(worst):
        drawn = ", ".join(f"{k}={v}" for k, v in r["drawn"].items() if k != "case")
        lines.append(f"- {run_name(r, len(seeds), draws)} ({r['case']}): {drawn}")
        if i < 3:
            lines += [f"  - {line}" for line in r["log"]]
    lines += [
        "",
        "## Every autotune run",
        "",
        "| landscape | family | case | final | @10 | @20 | cost | stopped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ours:
        lines.append(
            f"| {run_name(r, len(seeds), draws)} | {r['family']} | {r['case']} | {r['final']:.2f} | "
            f"{r['at10']:.2f} | {r['at20']:.2f} | {r['cost']:.1f} | {r['stopped']} |"
        )
    return lines
