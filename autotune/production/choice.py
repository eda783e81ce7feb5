"""Which configuration a production run restarts on after it failed.

The study knows every configuration it measured. After an OOM the run restarts on the fastest of
them that the failed one needs at least as much memory as, and more in some knob, in the knobs
that kind of failure depends on (the planner's dominance: every knob for a CUDA OOM, the vLLM
fraction and tensor parallelism for the KV cache, ...), with its accumulation set so that the
global batch (completions per optimizer step) stays the run's: the optimisation the user chose
goes on, only split differently. A hang is treated as memory trouble of every knob (a thrashing
allocator, swapping offload). When the study measured no such configuration, the planner's nearest
safer neighbour is proposed, and the run tries it as a short trial first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.moves import neighbors
from autotune.candidate.space import Space
from autotune.recipe import Recipe
from autotune.search.planner import Planner
from autotune.study.incidents import Incident
from autotune.study.record import TrialRow, candidate_key
from autotune.trial.outcome import Status

#: the ends a restart answers with less memory (a hang: a thrashing allocator, swapping offload)
MEMORY_TROUBLE = frozenset({Status.OOM, Status.HANG})


@dataclass
class Choice:
    """The configuration of the next attempt and where it comes from."""

    params: dict[str, Any]
    source: str  # "trial 3", "planner (short trial first)", "same configuration"
    probe: bool = False  # never measured: run it as a short trial before resuming on it


def memory_kind(status: str, oom_kind: str | None, recipe: Recipe) -> str:
    """The dominance a failure is judged by: its OOM kind; a hang by every knob."""
    if status == Status.OOM and oom_kind:
        return oom_kind
    return "host" if recipe.device == "cpu" else "cuda"


def keep_batch(params: dict[str, Any], completions: int | None, recipe: Recipe, space: Space) -> dict | None:
    """``params`` with its accumulation set so one optimizer step trains ``completions``
    completions, as the failed run did; None when its micro-batch cannot make that batch."""
    out = dict(params)
    if completions is None:
        return out
    batch = constraints.batch_of(out, recipe, space)
    if batch is not None and batch.accumulation is not None and out.get(batch.micro_batch) is not None:
        per_micro = int(out[batch.micro_batch]) * batch.gpus_factor(recipe.dp_gpus(out))
        if completions % per_micro:
            return None
        out[batch.accumulation] = completions // per_micro
    if constraints.samples_per_step(out, recipe, space) != completions:
        return None
    return out


def safer(planner: Planner, failed: dict[str, Any], cand: dict[str, Any], kind: str) -> bool:
    """The failed configuration needs at least what ``cand`` needs in the knobs of ``kind``, and
    ``cand`` needs strictly less somewhere: if the failed one fits nowhere, ``cand`` is the way down."""
    return planner.needs_at_least(failed, cand, kind) and not planner.needs_at_least(cand, failed, kind)


def doomed(planner: Planner, cand: dict[str, Any], history: list[Incident], recipe: Recipe) -> bool:
    """Whether ``cand`` needs at least the memory of a configuration a long run already lost."""
    return any(
        inc.status in MEMORY_TROUBLE
        and planner.needs_at_least(cand, inc.params, memory_kind(inc.status, inc.oom_kind, recipe))
        for inc in history
    )


def restart_choice(
    failed: dict[str, Any],
    status: str,
    oom_kind: str | None,
    *,
    rows: list[TrialRow],
    history: list[Incident],
    planner: Planner,
    space: Space,
    fixed: dict[str, Any],
    rules: list[Any],
) -> Choice | None:
    """The configuration to restart on after ``failed`` ended with ``status``/``oom_kind``.

    A crash (not about memory) or a timeout restarts on the same configuration; the supervisor
    allows that once. Otherwise the fastest measured safer configuration, else the planner's
    nearest safer neighbour (a probe), else None: nothing known is safer.
    """
    recipe = planner.recipe
    if status not in MEMORY_TROUBLE:
        return Choice(dict(failed), "same configuration")
    kind = memory_kind(status, oom_kind, recipe)
    completions = constraints.samples_per_step(failed, recipe, space)
    lost = {candidate_key(i.params) for i in history} | {candidate_key(failed)}
    # a trial stopped early for being slower than the best still ran its steps without running out
    # of memory, which is what a restart needs to know (it restarts on it rather than on a probe)
    measured = sorted(
        (r for r in rows if r.status == "ok" and r.launched and r.throughput),
        key=lambda r: -(r.throughput or 0.0),
    )
    for row in measured:
        cand = keep_batch(row.params, completions, recipe, space)
        if cand is None or candidate_key(cand) in lost or constraints.violations(cand, recipe, rules):
            continue
        if safer(planner, failed, cand, kind) and not doomed(planner, cand, history, recipe):
            return Choice(cand, f"trial {row.number}, measured {row.throughput:.3g} completions/s")
    options: list[tuple[int, dict[str, Any]]] = []
    for near in neighbors(failed, space, fixed, recipe, rules):
        cand = keep_batch(near, completions, recipe, space)
        if cand is None or candidate_key(cand) in lost or constraints.violations(cand, recipe, rules):
            continue
        if safer(planner, failed, cand, kind) and not doomed(planner, cand, history, recipe):
            if not planner.verdict(cand).skip:
                changed = sum(1 for k in cand if cand.get(k) != failed.get(k))
                options.append((changed, cand))
    if not options:
        return None
    fewest = min(c for c, _ in options)
    best = max((c for n, c in options if n == fewest), key=planner.expected_throughput)
    return Choice(best, "the planner's nearest safer configuration, tried as a short trial first", probe=True)
