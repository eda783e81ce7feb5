"""Which knobs' effect on memory the planner knows, and in which direction.

Dominance (a candidate that needs at least the memory of a measured OOM fails too) is only sound over
knobs whose direction is known. TRL's names are known to the memory model (``planner.memory_vector``),
ms-swift's extra ones are listed here, and a space in a trainer's own names may declare each
parameter's direction with ``memory: up | down | none`` (up: a larger value needs more GPU memory;
down: less; none: memory does not depend on it). Over every other knob nothing is known, so an OOM
speaks only for candidates equal to it there: a PPO trainer's ``adam_offload=true`` is not dominated
by an OOM measured with ``adam_offload=false``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from autotune.candidate.space import Space

# the names planner.memory_vector reads (TRL's), each with its direction built in
TRL_KNOWN = frozenset(
    {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_generations",
        "steps_per_generation",
        "generation_batch_size",
        "zero_stage",
        "offload",
        "gradient_checkpointing",
        "use_vllm",
        "vllm_mode",
    }
)
# read by memory_vector only for vLLM colocated with the trainer (use_vllm, vllm_mode colocate)
VLLM_COLOCATED = frozenset(
    {"vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_tensor_parallel_size"}
)
# vLLM's own knobs in a trainer that always runs vLLM on its GPUs (its space has no use_vllm switch,
# an OpenRLHF-style PPO trainer): the direction is vLLM's, whatever the trainer calls its other knobs
VLLM_ALWAYS = {
    "vllm_gpu_memory_utilization": "up",
    "vllm_enable_sleep_mode": "down",
    "vllm_tensor_parallel_size": "down",
}
# vLLM's share of the card: TRL's, ms-swift's and OpenRLHF's name, and vLLM's own engine argument,
# which trainers that hand it to vLLM as it is keep (verl's rollout.gpu_memory_utilization, NeMo-RL's
# vllm_cfg.gpu_memory_utilization, Unsloth's), and which vLLM's own KV-cache error names
VLLM_FRACTION = "vllm_gpu_memory_utilization"
VLLM_OWN_FRACTION = "gpu_memory_utilization"
# ms-swift's own knobs (autotune/spaces/swift.yaml). move_model_batches splits the weight sync into
# that many groups of layers (ms-swift's rollout_mixin; 0 here is its default, one group), so a
# larger value gathers fewer of a ZeRO-3 model's weights at once
BUILTIN = {
    "offload_optimizer": "down",
    "offload_model": "down",
    "sleep_level": "down",
    "move_model_batches": "down",
    "deepspeed_config": "none",
}
DIRECTIONS = ("up", "down", "none")
PEAK_STEP = 0.05  # a one-knob pair of measured peaks this far apart shows the knob's direction
PEAK_SAME = 0.02  # ... this close shows it does not move memory (an allocator's creep varies by ~2%)
CONTEXTS = 2  # settings of the other knobs a direction must be seen at before it carries dominance


class Measured(Protocol):
    """What :func:`learn` reads of a finished trial (the planner's ``Seen``)."""

    params: dict[str, Any]
    status: str
    oom_kind: str | None
    peak_gib: float | None
    leftover: bool


@dataclass(frozen=True)
class KnobMemory:
    """The memory direction of each knob of one space (declared, or known by name)."""

    declared: dict[str, str] = field(default_factory=dict)
    learned: dict[str, str] = field(default_factory=dict)  # directions measurements showed (see learn)
    hinted: dict[str, str] = field(default_factory=dict)  # at fewer than CONTEXTS settings: no dominance
    known_names: frozenset[str] = frozenset()  # the space's batch mapping (read as TRL's batch)
    choices: dict[str, tuple] = field(default_factory=dict)

    @property
    def shown(self) -> dict[str, str]:
        """Every direction measurements showed, whether it rules (learned) or only hints."""
        return {**self.hinted, **self.learned}

    @classmethod
    def of(cls, space: Space | None) -> KnobMemory:
        if space is None:
            return cls()
        batch = space.batch
        names = (
            {n for n in (batch.micro_batch, batch.accumulation, batch.generations) if n} if batch else set()
        )
        return cls(
            declared={n: p.memory for n, p in space.params.items() if p.memory},
            known_names=frozenset(names),
            choices={n: tuple(p.choices) for n, p in space.params.items() if p.choices is not None},
        )

    def direction(self, name: str, params: dict[str, Any]) -> str | None:
        """up / down / none, or None when the knob's effect on memory is unknown."""
        if name in self.declared:
            return self.declared[name]
        if name in TRL_KNOWN or name in self.known_names:
            return "none"  # counted by memory_vector already
        if name in VLLM_COLOCATED or name == fraction_knob(params):
            if "use_vllm" not in params:
                return VLLM_ALWAYS.get(name, "up")
            colocated = bool(params.get("use_vllm")) and params.get("vllm_mode", "colocate") == "colocate"
            return "none" if colocated or params.get("use_vllm") is False else None
        return BUILTIN.get(name, self.learned.get(name))

    def split(self, params: dict[str, Any]) -> tuple[tuple[float, ...], tuple[tuple[str, str], ...]]:
        """(components for knobs with a declared or built-in direction, oriented so that larger is
        more memory; the values of knobs whose effect is unknown)."""
        extra: list[float] = []
        unknown: list[tuple[str, str]] = []
        for name in sorted(params):
            way = self.direction(name, params)
            if way == "none":
                continue
            if way is None:
                unknown.append((name, repr(params[name])))
                continue
            value = params[name]
            if not self.ordered(name, value):  # not among its choices (an older study's): no order
                unknown.append((name, repr(value)))
                continue
            number = order_of(self, name, value)
            extra.append(number if way == "up" else -number)
        return tuple(extra), tuple(unknown)

    def spends(self, cand: dict[str, Any], here: dict[str, Any]) -> int:
        """Steps of ``cand`` away from ``here`` toward more memory, less those toward less, by the
        knobs whose direction is known, each value placed as the memory vector places it (``split``;
        one without a place is passed over). The walk breaks its ties by it (``Planner.next_local``):
        otherwise the order a space lists its choices in decided them, and reversing verl's lists took
        a third more of its searches to 0.95, nemo's three times as many."""
        total = 0
        for name, value in cand.items():
            way, was = self.direction(name, cand), here.get(name)
            if way not in ("up", "down") or was is None or value == was:
                continue
            if not (self.ordered(name, value) and self.ordered(name, was)):
                continue
            larger = order_of(self, name, value) > order_of(self, name, was)
            total += 1 if larger == (way == "up") else -1
        return total

    def rises(self, cand: dict[str, Any], here: dict[str, Any]) -> int:
        """Steps of ``cand`` up from ``here`` in the integer knobs whose effect on memory is unknown
        (verl's rollout TP), less those down: the walk's last tie-break (``Planner.next_local``), as
        the pool's is each integer's larger value (``planner.larger_first``). Without it the order a
        space lists its choices in decided: from TP 2, verl's walk tried 1 before 4, and its integer
        lists reversed took 17 of seed 0's runs above 0.95 and 4 below (docs/benchmarks-notes.md)."""
        total = 0
        for name, value in cand.items():
            was = here.get(name)
            if type(value) is not int or type(was) is not int or value == was:
                continue  # a switch is not an integer here, nor a float or a category
            if self.direction(name, cand) is None:
                total += 1 if value > was else -1
        return total

    def model_blind(self, params: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        """The values of the knobs that may move memory but the memory model does not read: a
        trainer's own knobs (``--command``: a PPO trainer's ``adam_offload`` or
        ``colocate_all_models``; ms-swift's ``offload_optimizer``, ``offload_model`` and
        ``move_model_batches``; vLLM's knobs where no ``use_vllm`` switch tells the model vLLM runs),
        whatever their direction. The model reads TRL's names, the space's batch mapping and
        ``sleep_level`` (which ``constraints.as_trl`` renames to TRL's); a knob declared or measured
        to move nothing (``none``) does not count."""
        out = []
        for name in sorted(params):
            if name in TRL_KNOWN or name in self.known_names or name == "sleep_level":
                continue
            if name in VLLM_COLOCATED and "use_vllm" in params:
                continue  # read by the model wherever vLLM shares the trainer's GPUs
            if self.direction(name, params) != "none":
                out.append((name, repr(params[name])))
        return tuple(out)

    def calibrated_for(
        self, params: dict[str, Any], at: dict[tuple[tuple[str, str], ...], dict[str, Any]]
    ) -> bool:
        """Whether the calibrated memory model may judge ``params``, given the settings ``at`` of
        the knobs it cannot read that measured peaks calibrated it at (each with one trial's knobs):
        one that bounds ``params`` below (:meth:`bounds_below`). Calibrated only at other settings
        of them, it knows nothing of these (issue 19 item 3, as an OOM over unknown knobs): PPO 1.5B
        on 8 x 24 GB vetoed its best (colocated, ZeRO-3) at 46 GiB on 22 GiB cards, calibrated only
        without colocation."""
        blind = self.model_blind(params)
        return not blind or blind in at or any(self.bounds_below(c, params) for c in at.values())

    def bounds_below(self, calibrated: dict[str, Any], params: dict[str, Any]) -> bool:
        """Whether a peak measured at ``calibrated`` makes the model's prediction for ``params`` a
        lower bound in the knobs the model cannot read: equal in each such knob of unknown direction,
        and needing no more memory in each of known direction (an Adam offload on where ``params``
        has it off). The model reads neither, so it predicts ``params`` as if it needed what
        ``calibrated`` did; ``params`` needs at least that, and a veto stays sound."""
        names = {n for n, _ in self.model_blind(params)} | {n for n, _ in self.model_blind(calibrated)}
        for name in names:
            if name not in params or name not in calibrated:
                return False
            way = self.direction(name, params)
            if way not in ("up", "down") or not (
                self.ordered(name, params[name]) and self.ordered(name, calibrated[name])
            ):
                if repr(params[name]) != repr(calibrated[name]):
                    return False
                continue
            here, there = order_of(self, name, params[name]), order_of(self, name, calibrated[name])
            if (there > here) if way == "up" else (there < here):
                return False
        return True

    def ordered(self, name: str, value: Any) -> bool:
        """Whether ``value`` has a place in the knob's order: a number or a switch, or one of its
        choices (one the space does not list, from an older study, is compared only for equality)."""
        return isinstance(value, int | float) or value in self.choices.get(name, ())

    def same_unknown(self, a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Whether two candidates agree in every knob whose effect on memory is unknown."""
        return self.split(a)[1] == self.split(b)[1]


def order_of(knobs: KnobMemory, name: str, value: Any) -> float:
    """A value's place in its knob's order: the number itself, or its index among the choices."""
    if name in knobs.choices and not isinstance(value, int | float):
        return float(knobs.choices[name].index(value)) if value in knobs.choices[name] else 0.0
    return float(value or 0)


def learn(knobs: KnobMemory, seen: Iterable[Measured]) -> KnobMemory:
    """Directions of unknown knobs shown by measurements: two trials that differ in that knob alone,
    one out of memory (a CUDA OOM on clean GPUs) and one that ran, say the value that ran needs less;
    two measured peaks more than :data:`PEAK_STEP` apart say the same, and two within
    :data:`PEAK_SAME` that memory does not depend on it (none). A knob whose pairs disagree stays
    unknown. A direction seen at at least :data:`CONTEXTS` settings of the other knobs is learned and
    carries dominance like a declared one (an OOM with activation offload on rules out the same batch
    with it off), where before an OOM vetoed only its equals. One seen at fewer is only hinted (a
    stated prior: one observation is no rule; the same configuration measured twice is one setting).
    Seen: PPO 1.5B on 8 x 24 GB, one pair at ZeRO-2 showed that colocating the four models needs more;
    an OOM at ZeRO-3 without colocation then ruled out the landscape's best, colocated at ZeRO-3,
    which fits (colocation puts every model on every GPU but lets vLLM sleep while they train, so its
    direction depends on the others). Two settings do not cover that in general: two pairs at ZeRO-2
    say no more of ZeRO-3 than one (tests/test_search_learned.py). A hint still tells the export's
    risk test which knob may set a success apart from an OOM (``headroom.unmeasured_risks``), where a
    held confirmation tests it. An OOM of a configuration that also ran (a short trial fine, its longer
    run dead: a confirmation or a production run) is at the edge, where the same configuration runs
    or dies by the allocator's luck: a pair with it shows the edge, not the knob. Seen: a plain 8B
    trainer, micro-batch 16 with fused Adam dead in its confirmation and its twin without fused Adam
    held, hinted that fused Adam needs more (it changes only speed); the hint cleared the twin of the
    edge and the export died in a long run."""
    base = replace(knobs, learned={}, hinted={})  # what is known without the measurements
    ran = [s.params for s in seen if s.status == "ok"]  # beside leftovers too: it ran even then
    done = [
        s
        for s in seen
        if not s.leftover
        and (s.status == "ok" or s.status == "oom" and s.oom_kind == "cuda" and s.params not in ran)
    ]
    votes: dict[str, dict[str, set]] = {}  # knob -> direction -> the other knobs' settings it was seen at
    for i, a in enumerate(done):
        for b in done[i + 1 :]:
            names = set(a.params) | set(b.params)
            differ = [n for n in names if a.params.get(n) != b.params.get(n)]
            if len(differ) != 1 or base.direction(differ[0], a.params) is not None:
                continue
            name = differ[0]
            # the other knobs' values, compared as the pair was (==): 1, 1.0 and True are one setting
            context = frozenset((n, v) for n, v in a.params.items() if n != name and v is not None)
            if a.status == b.status == "ok":
                if not (a.peak_gib and b.peak_gib):
                    continue
                apart = abs(a.peak_gib / b.peak_gib - 1)
                if apart <= PEAK_SAME:
                    votes.setdefault(name, {}).setdefault("none", set()).add(context)
                if apart <= PEAK_STEP:
                    continue
                big, small = (a, b) if a.peak_gib > b.peak_gib else (b, a)
            elif a.status != b.status:
                big, small = (a, b) if a.status == "oom" else (b, a)
            else:
                continue
            rise = order_of(knobs, name, big.params.get(name)) - order_of(knobs, name, small.params.get(name))
            votes.setdefault(name, {}).setdefault("up" if rise > 0 else "down", set()).add(context)
    agreed = {n: next(iter(v.items())) for n, v in votes.items() if len(v) == 1}
    learned = {n: way for n, (way, contexts) in agreed.items() if len(contexts) >= CONTEXTS}
    hinted = {n: way for n, (way, contexts) in agreed.items() if len(contexts) < CONTEXTS}
    if learned == knobs.learned and hinted == knobs.hinted:
        return knobs
    return replace(knobs, learned=learned, hinted=hinted)


def fraction_knob(params: dict[str, Any]) -> str | None:
    """The name of the knob that sets vLLM's share of the card in ``params`` (:data:`VLLM_FRACTION`,
    or vLLM's own :data:`VLLM_OWN_FRACTION`, alone or as the last part of a dotted name), or None.
    Each kind of vLLM failure is cured along it (a KV cache too small by a larger share, a start-up
    beside the trainer's states by a smaller one), whatever the trainer calls it: under another name
    a KV-cache failure had vetoed nothing and its cure had moved nothing."""
    if VLLM_FRACTION in params:
        return VLLM_FRACTION
    for name in params:
        if name == VLLM_OWN_FRACTION or name.endswith("." + VLLM_OWN_FRACTION):
            return name
    return None


def vllm_beside_trainer(params: dict[str, Any]) -> bool:
    """Whether vLLM shares the trainer's GPUs: TRL's colocate mode, or a trainer whose space has no
    ``use_vllm`` switch but sizes vLLM by its fraction (vLLM always runs, on the training GPUs)."""
    if "use_vllm" not in params:
        return fraction_knob(params) is not None
    return bool(params.get("use_vllm")) and params.get("vllm_mode", "colocate") == "colocate"
