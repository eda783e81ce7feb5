"""A switch or category that neither the memory side nor the speed prior reads has each of its values
run once, from the incumbent, before the search settles (search/coverage.py).

The space is the NeMo-RL-style one the benchmark holds out, read by the real loader: its
``recompute_granularity`` is declared nowhere and only counts with checkpointing on."""

from __future__ import annotations

from autotune.candidate.space_file import load_space
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.search.coverage import ATTEMPTS, open_value, unread
from autotune.search.knobs import KnobMemory
from autotune.search.planner import Planner
from autotune.sim.families import held_out_base, landscape
from autotune.study import candidate_key

SELECTIVE = {"activation_checkpointing": True, "recompute_granularity": "selective"}


def setting():
    space = load_space(landscape(held_out_base("nemo")).space)
    gpu = find_gpu_type("H100-80GB")
    recipe = Recipe(model="Qwen2.5-7B-Instruct", gpus=8, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib)
    return space, Planner(resolve_model(recipe.model), recipe, gpu, knobs=KnobMemory.of(space))


def test_only_switches_and_categories_nothing_reads_are_covered():
    space, planner = setting()
    here = space.normalize(space.defaults())
    # the declared savers (checkpointing, offload, SP) and the integers (TP, micro-batch) are the
    # model's, the prior's or the walk's; the recompute granularity nobody describes
    assert unread(planner, space, {}, here) == ["recompute_granularity"]
    # pinned, or where a pin forbids what it requires, it is not searched
    assert unread(planner, space, {"recompute_granularity": "full"}, here) == []
    assert unread(planner, space, {"activation_checkpointing": False}, here) == []
    # without the space's declarations the savers are unknown too (a bare planner knows TRL's names)
    bare = Planner(planner.model, planner.recipe, planner.gpu)
    assert "optimizer_cpu_offload" in unread(bare, space, {}, here)


def test_a_value_no_trial_ran_is_proposed_from_the_incumbent_with_what_it_requires():
    space, planner = setting()
    off = space.normalize({**space.defaults(), "activation_checkpointing": False})
    full = space.normalize(space.defaults())
    planner.observe(0, off, "ok", None, 40.0, throughput=5.0)
    planner.observe(1, full, "ok", None, 35.0, throughput=4.0)
    ran = [(off, "ok"), (full, "ok")]
    tried = {candidate_key(p) for p, _ in ran}

    def ask(incumbent, fixed=None):
        return open_value(planner, incumbent, space, fixed or {}, [], tried, candidate_key, ran)

    # from an incumbent without checkpointing, selective recomputation needs it on: both move
    cand = ask(off)
    assert cand == {**off, **SELECTIVE}
    # pinned off, checkpointing cannot be turned on for it: nothing to propose
    assert ask(off, {"activation_checkpointing": False}) is None
    # an OOM there says nothing of its speed: the value stays open from an incumbent it does not rule
    # out (more TP needs less memory) ...
    planner.observe(2, cand, "oom", "cuda", None)
    ran.append((cand, "oom"))
    tried.add(candidate_key(cand))
    assert ask(off) is None  # (its own candidate is answered)
    wider = {**off, "tensor_model_parallel_size": 4}
    assert ask(wider) == {**wider, **SELECTIVE}
    # ... until a trial holding it runs, or ATTEMPTS of them did not (a value that cannot run must not
    # hold the search open)
    ran.append(({**cand, "tensor_model_parallel_size": 8}, "crash"))
    assert ATTEMPTS == 2 and ask(wider) is None
    ran[-1] = ({**cand, "tensor_model_parallel_size": 8}, "ok")
    assert ask(wider) is None
    ran.pop()
    assert ask(wider) is not None
