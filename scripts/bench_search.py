#!/usr/bin/env python
"""Benchmark autotune's search against the baselines people use, on landscapes of several families.

    python scripts/bench_search.py [--landscapes 105] [--families trl,ppo,plain] [--trials 30] [--seed 0,1,2]

Each landscape (autotune/sim/families.py) is a trainer family (the GRPO simulator in TRL's names, a
four-model PPO trainer and a plain micro-batch trainer in their own names, through template spaces) on
drawn hardware under drawn physics (every memory and speed term x 0.7-1.4, vLLM's thresholds moved,
2-10% step-time noise from run to run and a third to three times that from step to step, 0-5% transient
NCCL crashes). Its ground truth is enumerated over the whole valid grid: *best possible* is the fastest
configuration that survives long runs (warm-up + 3 x measured steps, three truth seeds averaged, no
transient crash, no run-to-run noise: its expected throughput) with the headroom left free. Each
``--seed`` draws its own landscapes (the same cases by index, every physics term drawn anew) and
searches: several seeds report their runs together, so the worst runs include landscapes no tuning
looked at. Every policy spends up to ``--trials`` launched trials and is charged its whole cost (every
trial and confirmation, in trial-equivalents: loading plus 7 steps of the best configuration). autotune
runs through the real search loop (planner, Optuna, pruning, confirmation) with an in-process executor
whose failures are judged by autotune's real classifier from the text the trainer would print."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_landscapes import (  # noqa: E402
    CASES,
    ROOT,
    Case,
    Landscape,
    Quiet,
    build_landscape,
    make_recipe,
)
from bench_report import run_name, write_report  # noqa: E402

from autotune.candidate import constraints  # noqa: E402
from autotune.errors import SearchStopped  # noqa: E402
from autotune.recipe import Recipe  # noqa: E402
from autotune.runners import TrialContext  # noqa: E402
from autotune.search.confirm import CONFIRM_NUMBER_OFFSET  # noqa: E402
from autotune.search.loop import Search  # noqa: E402
from autotune.search.planner import Planner, Verdict  # noqa: E402
from autotune.search.policy import PROPOSAL_ATTR  # noqa: E402
from autotune.sim.families import (  # noqa: E402
    FAMILIES,
    HELD_OUT,
    HELD_OUT_BASE,
    HELD_OUT_RANGE,
    held_out_base,
    held_out_family,
    landscape,
)
from autotune.study import StudyPaths, candidate_key, choose_best, confirmations, rows  # noqa: E402
from autotune.study.incidents import long_run_failures  # noqa: E402
from autotune.study.ranking import Confirmation  # noqa: E402
from autotune.trial.control import StopRule, TrialControl  # noqa: E402
from autotune.trial.outcome import Outcome  # noqa: E402

__all__ = ["CASES", "Case", "Quiet", "build_landscape", "make_recipe"]
CHECKPOINTS = (10, 20, 30)


def short(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()))


@dataclass(frozen=True)
class Ran:
    """One run a search made (a trial, or a confirmation of trial ``number``): its configuration, and
    what it measured beside its value in truth (:meth:`Tracker.result`)."""

    number: int
    params: dict[str, Any]
    result: str
    proposer: str = ""  # which proposer made a search trial (seed, local, pool, valid, tpe, rerun)
    status: str = ""  # a search trial's outcome (ok, oom, crash, ...)

    def __str__(self) -> str:
        return f"{self.number}: {short(self.params)} -> {self.result}"


@dataclass
class Run:
    """What one policy did in one seed: per launch, the value of what it would export then."""

    values: list[float] = field(default_factory=list)
    hours: list[float] = field(default_factory=list)
    ooms: int = 0
    final: float = 0.0
    total_hours: float = 0.0
    stopped: str = ""
    exported: dict[str, Any] | None = None
    crashes: int = 0
    trials: list[Ran] = field(default_factory=list)  # each launched trial
    confirms: list[Ran] = field(default_factory=list)  # each confirmation run
    held_hours: list[float] = field(default_factory=list)  # GPU-hours of each confirmation that held in full
    measured: float = 0.0  # best possible value of any configuration a launched trial ran (kept headroom)
    # launched search trials by proposer (seed, local, pool, valid, tpe, rerun): {status: count}
    by_proposer: dict[str, dict[str, int]] = field(default_factory=dict)
    # autotune's planner as the search left it (bench_inspect.py asks it why); never pickled
    planner: Any = field(default=None, repr=False, compare=False)

    @property
    def log(self) -> list[str]:
        """One line per launched trial, as the report prints the worst runs'."""
        return [str(ran) for ran in self.trials]


class Tracker:
    """Wraps an executor: after every launch, notes the configuration the policy would export."""

    def __init__(self, land: Landscape, executor: Callable) -> None:
        self.land = land
        self.executor = executor
        self.run = Run()
        self.hours = 0.0
        self.choice: tuple[float, dict[str, Any]] | None = None
        self.crashes = 0

    def __call__(
        self, params: dict[str, Any], trial_dir: Path, number: int, control: TrialControl
    ) -> Outcome:
        before = self.executor.simulated_s
        outcome = self.executor(params, trial_dir, number, control)
        self.hours += (self.executor.simulated_s - before) * self.land.recipe.gpus / 3600
        if control.purpose == "confirm":
            # the search marks a cut run in its outcome after the executor returns; its control knows now
            cut = control.bar if control.cut else None
            c = replace(Confirmation.from_attr(outcome.to_json()), cut_below=cut)
            stopped = f", {c.cut_note}" if c.cut_below is not None else ""
            self.run.confirms.append(
                Ran(number % CONFIRM_NUMBER_OFFSET, params, self.result(params, outcome) + stopped)
            )
            if c.held:  # a run cut below its bar did not hold its steps
                self.run.held_hours.append(
                    (self.executor.simulated_s - before) * self.land.recipe.gpus / 3600
                )
            return outcome
        if outcome.status == "oom":
            self.run.ooms += 1
        if outcome.status == "crash":
            self.crashes += 1
        if outcome.status == "ok":  # measured: whether the choice then finds it is another matter
            self.run.measured = max(self.run.measured, self.land.safe_value(params))
        self.run.trials.append(Ran(number, params, self.result(params, outcome), status=str(outcome.status)))
        limit = self.land.recipe.gpu_memory_gib * (1 - self.land.recipe.headroom)
        if (
            outcome.status == "ok"
            and not outcome.pruned
            and outcome.throughput
            and (outcome.peak_memory_gib or 0) <= limit
            and (self.choice is None or outcome.throughput > self.choice[0])
        ):
            self.choice = (outcome.throughput, params)
        self.run.values.append(self.land.value(self.choice[1] if self.choice else None))
        self.run.hours.append(self.hours)
        return outcome

    def result(self, params: dict[str, Any], outcome: Outcome) -> str:
        """What a run measured, and its configuration's value in truth, as the log keeps them; a value
        that long runs reach only inside the headroom says so (it counts for nothing as *measured*, and
        the best possible is taken without it)."""
        value = self.land.value(params)
        inside = ", peaks inside the headroom" if value and not self.land.safe_value(params) else ""
        return (
            f"{outcome.status}"
            f"{'/' + outcome.oom_kind if outcome.oom_kind else ''}"
            f"{f' {outcome.throughput:.3g}/s' if outcome.throughput else ''}"
            f"{f' peak {outcome.peak_memory_gib:.1f}' if outcome.peak_memory_gib else ''}"
            f" (true {value / max(self.land.best, 1e-9):.2f}{inside})"
        )


def simple_executor(land: Landscape, seed: int) -> Any:
    return land.executor(seed)


def run_fixed_list(
    land: Landscape, seed: int, order: list[dict[str, Any]], trials: int, adaptive: Callable | None = None
) -> Run:
    """Baselines: launch candidates in a given order (or as an adaptive function decides), then
    confirm the pick the way autotune does (a longer run of the leader; the next one if it dies),
    charged to the baseline's cost, so every policy is scored on a confirmed choice."""
    tracker = Tracker(land, simple_executor(land, seed))
    rule = StopRule(
        warmup=land.recipe.warmup_steps, measure=land.recipe.measure_steps, adaptive=False, prune=False
    )
    measured: list[tuple[float, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:

        def launch(params: dict[str, Any]) -> Outcome:
            n = len(tracker.run.values)
            outcome = tracker(params, Path(tmp) / str(n), n, TrialControl(rule))
            if tracker.choice is not None and tracker.choice[1] is params:
                measured.append(tracker.choice)
            return outcome

        if adaptive is not None:
            adaptive(launch, trials)
        else:
            for params in order[:trials]:
                launch(params)
        tracker.run.final = 0.0
        limit = land.recipe.gpu_memory_gib * (1 - land.recipe.headroom)
        for _, params in sorted(measured, key=lambda t: -t[0])[:3]:
            confirm_rule = StopRule.confirming(land.recipe)
            outcome = tracker(params, Path(tmp) / "confirm", 0, TrialControl(confirm_rule, purpose="confirm"))
            if outcome.status == "ok" and (outcome.peak_memory_gib or 0) <= limit:
                tracker.run.exported = params
                tracker.run.final = land.value(params)
                break
    tracker.run.total_hours = tracker.hours
    return tracker.run


def defaults_with(land: Landscape, **changes: Any) -> dict[str, Any] | None:
    """The space's defaults with some knobs changed, if that candidate is in the valid grid."""
    space = land.context.space
    if land.case.family == "trl":
        cand = {**space.defaults(), "gradient_accumulation_steps": 0, **changes}
        cand = space.normalize(constraints.derive(cand, land.recipe))
        return None if constraints.violations(cand, land.recipe) else cand
    cand = space.normalize({**space.defaults(), **{k: v for k, v in changes.items() if k in space.params}})
    keys = {candidate_key(c) for c in land.candidates}
    return cand if candidate_key(cand) in keys else None


def micro_knob(land: Landscape) -> str:
    batch = land.context.space.batch
    return batch.micro_batch if batch is not None else "per_device_train_batch_size"


def policy_random(land: Landscape, seed: int, trials: int) -> Run:
    order = list(land.candidates)
    random.Random(seed).shuffle(order)
    return run_fixed_list(land, seed, order, trials)


def policy_grid(land: Landscape, seed: int, trials: int) -> Run:
    """A hand-written sweep: ZeRO stage x micro-batch x checkpointing x vLLM fraction, nested (the
    other families: their space's knobs nested in the order the file lists them)."""
    space = land.context.space
    if land.case.family != "trl":
        return run_fixed_list(land, seed, list(land.candidates), trials)
    order = []
    for stage, bs, gc, frac in itertools.product(
        (3, 2, 1), space.params["per_device_train_batch_size"].choices, (True, False), (0.3, 0.5, 0.7)
    ):
        cand = defaults_with(
            land,
            zero_stage=stage,
            per_device_train_batch_size=bs,
            gradient_checkpointing=gc,
            vllm_gpu_memory_utilization=frac,
        )
        if cand is not None and cand not in order:
            order.append(cand)
    return run_fixed_list(land, seed, order, trials)


def policy_deepspeed(land: Landscape, seed: int, trials: int) -> Run:
    """DeepSpeed-autotuning style: per ZeRO stage, binary-search the largest micro-batch that fits
    (the rest at defaults), measuring throughput along the way; the fastest measured wins."""
    micro = micro_knob(land)
    sizes = list(land.context.space.params[micro].choices)
    stage_param = land.context.space.params.get("zero_stage")
    stages = stage_param.choices if stage_param is not None else [None]

    def search(launch: Callable, budget: int) -> None:
        used = 0
        for stage in stages:
            lo, hi = 0, len(sizes) - 1
            while lo <= hi and used < budget:
                mid = (lo + hi) // 2
                pins = {"zero_stage": stage} if stage is not None else {}
                cand = defaults_with(land, **pins, **{micro: sizes[mid]})
                if cand is None:
                    hi = mid - 1
                    continue
                used += 1
                if launch(cand).status == "ok":
                    lo = mid + 1
                else:
                    hi = mid - 1

    return run_fixed_list(land, seed, [], trials, adaptive=search)


def policy_hf(land: Landscape, seed: int, trials: int) -> Run:
    """accelerate's find_executable_batch_size: start at the largest batch, halve on OOM."""
    micro = micro_knob(land)
    sizes = sorted(land.context.space.params[micro].choices, reverse=True)

    def search(launch: Callable, budget: int) -> None:
        for bs in sizes[:budget]:
            cand = defaults_with(land, **{micro: bs})
            if cand is not None and launch(cand).status == "ok":
                return

    return run_fixed_list(land, seed, [], trials, adaptive=search)


#: Times a search stopped by the same crash three times in a row is resumed, as its message tells
#: the user to (``autotune resume``): on a landscape that crashes up to 5% of trials at random, three
#: in a row come now and then, and a user resumes. A search that stops once more is scored by what
#: its best/ holds then (the loop exports each new best as it comes, unconfirmed).
RESUMES = 2


ORACLES = ("memory", "prior")


def oracle_of(text: str) -> frozenset[str] | None:
    """``--oracle``'s value as the sides it names, None where it names one that is not an oracle."""
    oracle = frozenset(o for o in text.split(",") if o)
    return None if oracle - set(ORACLES) else oracle


def tell_truth(planner: Planner, land: Landscape) -> None:
    """Give the search's planner what ``--oracle`` names, from the landscape's truth: ``memory``, a veto
    of every configuration a long run of which dies or peaks inside the headroom (what *best possible*
    leaves out), as a perfect memory model and a trainer that always logged its peak would give;
    ``prior``, each configuration's long-run throughput as the speed prior (inside the headroom too: a
    prior says speed, not room), floored where it dies, since the search divides by its prior. The
    floor leaks what dies into the ranking, never into a veto: the search still launches it if it is
    all there is. Each is an upper bound on what knowing that side better could buy."""
    floor = 1e-3 * max(land.best, 1e-9)

    def truth(params: dict[str, Any], safe: bool) -> float:
        try:  # the planner also asks of partial configurations (a knob set into another's)
            full = params if land.case.family == "trl" else land.complete(params)
            return land.safe_value(full) if safe else land.value(full)
        except (KeyError, ValueError):
            return 0.0

    if "memory" in land.oracle:
        verdict = planner.verdict

        def vetoed(params: dict[str, Any]) -> Verdict:
            said = verdict(params)
            if not said.skip and truth(params, safe=True) == 0:
                return Verdict(
                    True, "dies or peaks inside the headroom in truth (--oracle)", said.predicted_gib
                )
            return said

        planner.verdict = vetoed  # type: ignore[method-assign]
    if "prior" in land.oracle:
        planner.prior = lambda params: max(truth(params, safe=False), floor)  # type: ignore[method-assign]
        # the search's start-up check ranked the grid by the old prior, and the pool is ranked once
        # a search: without this the seeds and the pool kept the old order (the first runs' flaw)
        planner._pool = None  # noqa: SLF001


def told_search(land: Landscape, recipe: Recipe, folder: Path, execute: Any, storage: Any) -> Search:
    """autotune's search of ``land`` in ``folder``, its planner told what ``--oracle`` names."""
    context = TrialContext(recipe, land.context.space, land.context.model, land.context.gpu)
    search = Search(
        recipe,
        StudyPaths(folder, recipe.name),
        context,
        Quiet(recipe.trials),
        execute=execute,
        storage=storage,
        report=False,
    )
    if land.oracle and search.planner is not None:
        tell_truth(search.planner, land)
    return search


def policy_autotune(land: Landscape, seed: int, trials: int) -> Run:
    recipe = make_recipe(land.case, seed, trials)
    tracker = Tracker(land, land.executor(seed))
    storage = optuna.storages.InMemoryStorage()
    result, stops = None, []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(RESUMES + 1):  # the same study each time, as `autotune resume` continues it
            search = told_search(land, recipe, Path(tmp), tracker, storage)
            try:
                result = search.run()
                break
            except SearchStopped as exc:
                stops.append(str(exc).split(" (see ", 1)[0])
    # which proposer made each launched trial (a trial TPE sampled carries no proposal attribute; a
    # transient crash's re-run is queued whole, by the loop, not proposed)
    proposers: dict[int, str] = {}
    for name in optuna.get_all_study_names(storage):
        for t in storage.get_all_trials(storage.get_study_id_from_name(name), deepcopy=False):
            rerun = "rerun" if "rerun_of" in t.user_attrs else "tpe"
            proposers[t.number] = t.system_attrs.get(PROPOSAL_ATTR, rerun)
    tracker.run.trials = [replace(r, proposer=proposers.get(r.number, "")) for r in tracker.run.trials]
    for r in tracker.run.trials:
        counts = tracker.run.by_proposer.setdefault(r.proposer, {})
        counts[r.status] = counts.get(r.status, 0) + 1
    if result is not None:
        best = result.best
        tracker.run.stopped = (result.stopped_reason or "").split(": ", 1)[-1]
        if stops:
            tracker.run.stopped += f" (resumed after: {'; '.join(stops)})"
    else:
        study = search.state.study
        best, _ = choose_best(rows(study), recipe, confirmations(study), long_run_failures(study))
        tracker.run.stopped = f"stopped {len(stops)} times (resumed {len(stops) - 1}): {stops[-1]}"
    tracker.run.exported = best.params if best else None
    tracker.run.final = land.value(tracker.run.exported)
    tracker.run.crashes = tracker.crashes
    tracker.run.total_hours = tracker.hours
    tracker.run.planner = search.planner
    return tracker.run


POLICIES: dict[str, Callable[[Landscape, int, int], Run]] = {
    "autotune": policy_autotune,
    "random": policy_random,
    "grid": policy_grid,
    "deepspeed-style": policy_deepspeed,
    "hf-halving": policy_hf,
}


def at(run: Run, n: int) -> float:
    if not run.values:
        return 0.0
    return run.values[min(n, len(run.values)) - 1]


def cost(land: Landscape, run: Run) -> float:
    """The whole search (every trial, confirmations included) in trial-equivalents."""
    return run.total_hours * 3600 / land.recipe.gpus / land.trial_equivalent_s


def record(land: Landscape, name: str, run: Run) -> dict[str, Any]:
    """One policy's run on one landscape, as the report keeps it. The landscape's drawn physics and the
    trial log are autotune's only (the report lists autotune's worst runs with them)."""
    best = max(land.best, 1e-9)
    d = land.case
    ours = name == "autotune"
    return {
        "landscape": d.index,
        "family": d.family,
        "case": d.name,
        "policy": name,
        **({"drawn": d.drawn} if ours else {}),
        "best_possible": best,
        "nothing_fits": land.best == 0,  # not the clamped best above, which is never 0
        "fitting": sum(1 for v in land.safe.values() if v > 0),
        "valid": len(land.candidates),
        **{f"at{n}": at(run, n) / best for n in CHECKPOINTS},
        "final": run.final / best,
        # the same counted only if a long run of it also keeps the headroom free in truth (the score
        # counts its throughput all the same: no measurement the search had showed it inside)
        "final_safe": land.safe_value(run.exported) / best if run.exported else 0.0,
        "measured_best": run.measured / best,
        "by_proposer": run.by_proposer,
        "cost": cost(land, run),
        "launched": len(run.values),
        "ooms": run.ooms,
        "crashes": run.crashes,
        "stopped": run.stopped,
        "exported": run.exported,
        "log": run.log if ours else [],
        # each launched trial: number, proposer, status, value and safe value in truth (of the best),
        # configuration; written to the JSON with --keep-trials only (scripts/bench_proposers.py)
        "trials": [
            [
                r.number,
                r.proposer,
                r.status,
                land.value(r.params) / best,
                land.safe_value(r.params) / best,
                r.params,
            ]
            for r in run.trials
        ]
        if ours
        else [],
    }


def quiet() -> None:
    """Errors only, from autotune and Optuna: hundreds of searches' progress would bury the table."""
    logging.getLogger("autotune").setLevel(logging.ERROR)
    optuna.logging.set_verbosity(optuna.logging.ERROR)


#: The bound on ``--seed``, ``--luck`` and a seed's landscape indices: below it every (seed, landscape,
#: luck) gives its search a seed of its own (:func:`search_seed`).
APART = 1000
# numpy's seeds end at 2**32: a fourth held-out family's would pass it (give it another scheme)
assert (len(HELD_OUT) + 1) * APART**3 < 2**32, "too many held-out families for search_seed's scheme"


def search_seed(seed: int, index: int, luck: int = 0) -> int:
    """The seed a policy's search of landscape ``index`` under ``--seed seed`` runs with: its trials'
    run-to-run noise and transient crashes, and the samplers' draws. ``luck`` (``--luck``) draws them
    anew on the same landscapes. A held-out family's landscapes take seeds apart from every rotation
    landscape's and from each other held-out family's: the k-th family's from (k + 1) x APART**3."""
    held = held_out_family(index)
    if held is not None:
        slot = HELD_OUT.index(held) + 1
        return slot * APART**3 + (luck * APART + seed) * APART + index - held_out_base(held)
    return (luck * APART + seed) * APART + index


def run_landscape(
    job: tuple[Any, list[str], int, int, int, bool, frozenset[str]],
) -> tuple[Any, list[dict[str, Any]]]:
    """Every policy on one landscape (a unit of work for --jobs)."""
    d, policies, trials, seed, luck, exact, oracle = job
    quiet()
    land = build_landscape(d, trials, exact=exact)
    land.oracle = oracle
    # the JSON of the benchmark's own draw, measured as it is, stays as it was
    drawn = {
        **({"luck": luck} if luck else {}),
        **({"exact": True} if exact else {}),
        **({"oracle": ",".join(sorted(oracle))} if oracle else {}),
    }
    return d, [
        {
            "seed": seed,
            **drawn,
            **record(land, name, POLICIES[name](land, search_seed(seed, d.index, luck), trials)),
        }
        for name in policies
    ]


#: What the JSON keeps of a baseline's run: its name and the figures the report's tables count.
BASELINE_FIELDS = (
    *("seed", "luck", "exact", "oracle", "landscape", "family", "policy"),
    *("final", "final_safe", "fitting", "cost", "at20", "ooms", "launched"),
)


def kept(row: dict[str, Any], keep_trials: bool) -> dict[str, Any]:
    """A run as the JSON beside the report keeps it, one row a line (a rerun's diff shows the runs
    that moved). docs/benchmarks.json is tracked and holds three seeds under three draws, five
    policies each (whole rows came to over 4 MB), so it keeps what the scripts that read it use:
    autotune's runs without their trial logs (``bench_inspect.py SEED/INDEX --luck N`` replays any run
    with more, and the report prints the worst three's) and without ``trials`` unless
    ``--keep-trials``; the baselines' by :data:`BASELINE_FIELDS` (their exports are reproduced by the
    seed)."""
    if row["policy"] != "autotune":
        return {k: v for k, v in row.items() if k in BASELINE_FIELDS}
    return {k: v for k, v in row.items() if k != "log" and (k != "trials" or keep_trials)}


def numbers_of(text: str) -> list[int]:
    """``--seed`` or ``--luck``: one or several, comma-separated (``0,1,2``); ValueError if not whole
    numbers below :data:`APART`, each once."""
    seeds = [int(part) for part in text.split(",") if part.strip()]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0 or max(seeds) >= APART:
        raise ValueError(text)
    return seeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landscapes", type=int, default=105)
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help="comma-separated: trl,ppo,plain; or one held-out family alone, verl or nemo "
        "(docs/benchmarks-heldout.md)",
    )
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument(
        "--seed",
        default="0",
        help="draws the landscapes and the searches; several, comma-separated, are reported together",
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--jobs", type=int, default=1, help="landscapes run in parallel processes")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument(
        "--keep-trials",
        action="store_true",
        help="keep every autotune run's launched trials in the JSON (for scripts/bench_proposers.py)",
    )
    parser.add_argument(
        "--luck",
        default="0",
        help="draw the searches' luck anew (run-to-run noise, transient crashes, the samplers' draws) on "
        "the same landscapes: 1, 2, ... (0, the default, is the benchmark's own draw); several, "
        "comma-separated (0,1,2), are reported together and each apart; scripts/bench_compare.py tells "
        "a change from such a draw",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="measure every trial and confirmation without run-to-run or step-to-step noise and without "
        "transient crashes, on the same landscapes (a configuration's memory luck, the allocator's creep "
        "and fragmentation, stays as the truth has it): what the search reaches when its throughputs are "
        "exact; scripts/bench_compare.py against the same run without it tells the noise's share of the "
        "misses. Give it an --out of its own",
    )
    parser.add_argument(
        "--oracle",
        default="",
        help="tell autotune's planner the landscape's truth: memory (skip every configuration that dies "
        "or peaks inside the headroom in a long run, as a perfect memory model would), prior (rank by "
        "each configuration's true throughput instead of the speed prior), or memory,prior: bounds on "
        "what knowing one side better could buy, compared with scripts/bench_compare.py against the "
        "same run without it. Give it an --out of its own",
    )
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in FAMILIES + HELD_OUT] + [
        p for p in args.policies.split(",") if p not in POLICIES
    ]
    if bad:
        print(
            f"error: unknown {', '.join(bad)}: families are {', '.join(FAMILIES + HELD_OUT)}, "
            f"policies {', '.join(POLICIES)}"
        )
        return 2
    held_out = [f for f in families if f in HELD_OUT]
    if held_out and len(families) > 1:
        print(
            f"error: --families {args.families}: the held-out {held_out[0]} is benchmarked alone: "
            f"--families {held_out[0]}"
        )
        return 2
    try:
        seeds = numbers_of(args.seed)
    except ValueError:
        print(
            f"error: --seed {args.seed}: give whole numbers 0-999, each once, comma-separated: --seed 0,1,2"
        )
        return 2
    try:
        lucks = numbers_of(args.luck)
    except ValueError:
        print(
            f"error: --luck {args.luck}: give whole numbers 0-999 (0: the benchmark's own draw), each once, "
            "comma-separated: --luck 0,1,2"
        )
        return 2
    oracle = oracle_of(args.oracle)
    if oracle is None:
        print(f"error: --oracle {args.oracle}: give memory, prior or memory,prior")
        return 2
    if oracle and args.out.resolve().parent == (ROOT / "docs").resolve():
        print(f"error: --oracle writes {args.out}: give --out a file outside docs/, as --out /tmp/oracle.md")
        return 2
    if args.exact and args.out.resolve().parent == (ROOT / "docs").resolve():
        # the documented reports are the benchmark as measured: an exact run beside them is a measurement
        print(f"error: --exact writes {args.out}: give --out a file outside docs/, as --out /tmp/exact.md")
        return 2
    if held_out and args.landscapes > HELD_OUT_RANGE:  # past its range the next family's begin
        print(f"error: --landscapes {args.landscapes}: too many of --families {args.families}; give fewer")
        return 2
    try:  # made before the searches run: a folder missing at the end lost a whole night's runs
        args.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: --out {args.out}: its folder cannot be made ({exc.strerror}): give another --out")
        return 2
    logging.basicConfig(level=logging.WARNING)
    quiet()
    started = time.time()
    jobs = []
    for seed in seeds:
        chosen, index = [], 0
        if held_out:  # numbered apart from the rotation's and each other's (sim/families.py)
            first = held_out_base(held_out[0])
            chosen = [landscape(first + k, seed) for k in range(args.landscapes)]
        while len(chosen) < args.landscapes and index < HELD_OUT_BASE:
            d = landscape(index, seed)
            index += 1
            if d.family in families:
                chosen.append(d)
        if len(chosen) < args.landscapes:
            print(
                f"error: --landscapes {args.landscapes}: too many of --families {args.families}; give fewer"
            )
            return 2
        jobs += [
            (d, args.policies.split(","), args.trials, seed, luck, args.exact, oracle)
            for luck in lucks
            for d in chosen
        ]
    rows: list[dict[str, Any]] = []
    # landscapes are independent: processes change the wall time, not one figure (rows keep their order)
    with multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else nullcontext() as pool:
        results = pool.imap(run_landscape, jobs) if pool else map(run_landscape, jobs)
        for done, (d, landscape_rows) in enumerate(results, start=1):
            rows += landscape_rows
            ours = landscape_rows[0]
            print(
                f"[{done}/{len(jobs)}] {run_name(ours, len(seeds), len(lucks))} {d.family} {d.name}: "
                f"{ours['policy']} {ours['final']:.0%} cost {ours['cost']:.1f} ({ours['stopped'][:60]})",
                flush=True,
            )
    lines = write_report(rows, args, time.time() - started)
    args.out.write_text("\n".join(lines) + "\n")
    body = ",\n".join(json.dumps(kept(r, args.keep_trials), default=str, separators=(",", ":")) for r in rows)
    args.out.with_suffix(".json").write_text(f"[\n{body}\n]\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
