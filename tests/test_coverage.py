"""A switch or category that neither the memory side nor the speed prior reads has each of its values
measured once, from the incumbent, before the search settles (search/coverage.py).

The space is the NeMo-RL-style one the benchmark holds out, read by the real loader: its
``recompute_granularity`` is declared nowhere and only counts with checkpointing on."""

from __future__ import annotations

from autotune.candidate.space_file import load_space
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.search.coverage import open_value, unread
from autotune.search.knobs import KnobMemory
from autotune.search.planner import Planner
from autotune.sim.families import held_out_base, landscape
from autotune.study import candidate_key


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
    assert unread(planner, space, {"recompute_granularity": "full"}, here) == []


def test_a_value_no_success_ran_is_proposed_from_the_incumbent_with_what_it_requires():
    space, planner = setting()
    rules = []
    off = space.normalize({**space.defaults(), "activation_checkpointing": False})
    planner.observe(0, off, "ok", None, 40.0, throughput=5.0)
    planner.observe(1, space.normalize(space.defaults()), "ok", None, 35.0, throughput=4.0)
    tried = {candidate_key(s.params) for s in planner.seen}
    cand = open_value(planner, off, space, {}, rules, tried, candidate_key)
    # from an incumbent without checkpointing, selective recomputation needs it on: both move
    assert cand == {**off, "activation_checkpointing": True, "recompute_granularity": "selective"}
    # an OOM there says nothing of its speed: the value stays open from an incumbent it does not rule
    # out (more TP needs less memory), and closes once a success holds it
    planner.observe(2, cand, "oom", "cuda", None)
    tried.add(candidate_key(cand))
    assert open_value(planner, off, space, {}, rules, tried, candidate_key) is None
    wider = {**off, "tensor_model_parallel_size": 4}
    assert open_value(planner, wider, space, {}, rules, tried, candidate_key) == {
        **wider,
        "activation_checkpointing": True,
        "recompute_granularity": "selective",
    }
    planner.observe(3, {**cand, "tensor_model_parallel_size": 8}, "ok", None, 30.0, throughput=4.5)
    assert open_value(planner, wider, space, {}, rules, tried, candidate_key) is None
