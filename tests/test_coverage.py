"""A switch or category that neither the memory side nor the speed prior reads has each of its values
run once, from the incumbent, before the search settles (search/coverage.py); where the search would
stop, vLLM's share, which the prior does not read for such a trainer, goes up as far as the measured
peak leaves room for (coverage.larger_share).

The space is the NeMo-RL-style one the benchmark holds out, read by the real loader: its
``recompute_granularity`` is declared nowhere and only counts with checkpointing on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import autotune
from autotune.candidate.space_file import load_space
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.search.coverage import ATTEMPTS, larger_share, open_value, unread
from autotune.search.knobs import KnobMemory
from autotune.search.planner import Planner
from autotune.search.walk import Walk
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
    # peaks at the limit leave no room to raise vLLM's share (the next test)
    planner.observe(0, off, "ok", None, 75.0, throughput=5.0)
    planner.observe(1, full, "ok", None, 75.0, throughput=4.0)
    ran = [(off, "ok"), (full, "ok")]
    tried = {candidate_key(p) for p, _ in ran}

    def ask(incumbent, fixed=None):
        return open_value(Walk.of(planner, space, fixed or {}, [], tried, candidate_key), incumbent, ran)

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


def test_vllm_s_share_is_raised_where_the_measured_peak_leaves_room_for_all_of_it():
    """vLLM's own docs: a larger ``gpu_memory_utilization`` gives the engine more KV cache and fewer
    preemptions, at the cost of memory alone. Where the speed prior does not read the share, the
    walk raises it from the incumbent as far as the measured peak leaves room for every byte of it
    (the engine may sit beside the trainer), step by measured step, and stops after ATTEMPTS that
    did not run."""
    space, planner = setting()
    here = space.normalize(space.defaults())  # the engine at 0.6 of an 80 GB card; limit 76 GiB
    limit = planner.recipe.gpu_memory_gib * (1 - planner.recipe.headroom)
    ran: list[tuple[dict, str]] = []
    tried: set[str] = set()

    def ask():
        return larger_share(Walk.of(planner, space, {}, [], tried, candidate_key), here, ran)

    assert ask() is None  # no peak measured at these knobs: no room is known
    planner.observe(0, here, "ok", None, limit - 13.0, throughput=5.0)
    ran.append((here, "ok"))
    tried.add(candidate_key(here))
    assert ask()["gpu_memory_utilization"] == 0.7  # 13 GiB of room: 0.1 of the card, not 0.2
    planner.seen[0] = replace(planner.seen[0], peak_gib=limit - 30.0)
    assert ask()["gpu_memory_utilization"] == 0.9  # 30 GiB: the largest value
    # the step ran and its peak did not move (an engine that sleeps while the trainer trains): the
    # room is read again above it
    planner.seen[0] = replace(planner.seen[0], peak_gib=limit - 13.0)
    up = {**here, "gpu_memory_utilization": 0.7}
    planner.observe(1, up, "ok", None, limit - 13.0, throughput=5.0)
    ran.append((up, "ok"))
    tried.add(candidate_key(up))
    assert ask()["gpu_memory_utilization"] == 0.8
    # while that raise runs (--parallel), the next slot does not step down past it to 0.7
    running = {candidate_key({**here, "gpu_memory_utilization": 0.8})}
    assert larger_share(Walk.of(planner, space, {}, [], tried, candidate_key), here, ran, running) is None
    # on CPU (vLLM's CPU backend sizes its cache by its own setting) it is left alone
    gpu = planner.recipe
    planner.recipe = replace(gpu, device="cpu", memory_limit_gib=gpu.gpu_memory_gib)
    assert ask() is None
    planner.recipe = gpu
    # two launches above every share that ran, that ran out of memory or crashed, settle it
    for share, status in ((0.8, "oom"), (0.9, "crash")):
        ran.append(({**here, "gpu_memory_utilization": share}, status))
    assert ATTEMPTS == 2 and ask() is None
    # pinned, it is not searched; pinned elsewhere, the incumbent's other knobs have their own peaks
    ran = ran[:2]
    assert (
        larger_share(
            Walk.of(planner, space, {"gpu_memory_utilization": 0.6}, [], tried, candidate_key), here, ran
        )
        is None
    )
    wider = {**here, "tensor_model_parallel_size": 4}
    assert larger_share(Walk.of(planner, space, {}, [], tried, candidate_key), wider, ran) is None


def test_without_a_measured_peak_the_share_goes_up_one_value_at_a_time():
    """A trainer that logs no memory, on a machine NVML cannot see: no trial says how much room there
    is, so the walk raises vLLM's share one value above the largest that ran at the incumbent's other
    knobs, and each raise that runs is the next one's floor (0/#2008 of the NeMo-RL-style family
    stopped converged at 0.64 on the default 0.6, every good configuration at 0.7 or more)."""
    space, planner = setting()
    here = space.normalize(space.defaults())  # the engine at 0.6
    ran: list[tuple[dict, str]] = []
    tried: set[str] = set()

    def ask(running=()):
        return larger_share(Walk.of(planner, space, {}, [], tried, candidate_key), here, ran, running)

    def measure(number, params, status="ok"):
        planner.observe(number, params, status, None if status == "ok" else "cuda", None, throughput=5.0)
        ran.append((params, status))
        tried.add(candidate_key(params))

    assert ask() is None  # nothing ran at these knobs
    measure(0, here)
    assert ask()["gpu_memory_utilization"] == 0.7  # one value up, not as far as the card goes
    measure(1, {**here, "gpu_memory_utilization": 0.7})
    assert ask()["gpu_memory_utilization"] == 0.8
    assert ask(running={candidate_key({**here, "gpu_memory_utilization": 0.8})}) is None
    # ATTEMPTS launches above the floor that did not run settle it, 0.8 still untried
    ran += [
        ({**here, "gpu_memory_utilization": 0.9}, "oom"),
        ({**here, "gpu_memory_utilization": 0.9}, "crash"),
    ]
    assert ATTEMPTS == 2 and ask() is None
    del ran[-2:]
    assert ask()["gpu_memory_utilization"] == 0.8
    # a raise that did not run is not launched again
    measure(2, {**here, "gpu_memory_utilization": 0.8}, "oom")
    assert ask() is None
    # another setting of the other knobs has its own floor
    wider = {**here, "tensor_model_parallel_size": 4}
    assert larger_share(Walk.of(planner, space, {}, [], tried, candidate_key), wider, ran) is None
    # a share without a step (64 points of 0.3-0.9) still goes up by a tenth of its range, not by 1/63
    space.params["gpu_memory_utilization"] = replace(space.params["gpu_memory_utilization"], step=None)
    del ran[:]
    ran.append((here, "ok"))
    raised = larger_share(Walk.of(planner, space, {}, [], set(), candidate_key), here, ran)
    assert 0.66 - 1e-9 <= raised["gpu_memory_utilization"] < 0.67


def test_the_share_is_left_to_the_prior_where_the_prior_reads_it():
    """TRL's colocated engine: the speed prior reads its share (its KV cache against the rollout,
    candidate/speed.py), so its ranking weighs it already and the share is not raised on top."""
    space = load_space(Path(autotune.__file__).parent / "spaces" / "grpo.yaml")
    gpu = find_gpu_type("H100-80GB")
    recipe = Recipe(model="Qwen2.5-7B-Instruct", gpus=8, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib)
    planner = Planner(resolve_model(recipe.model), recipe, gpu, knobs=KnobMemory.of(space))
    here = {**space.normalize(space.defaults()), "vllm_gpu_memory_utilization": 0.3}
    assert here["vllm_mode"] == "colocate"
    # the prior reads it: a smaller KV cache generates in more waves
    assert planner.prior({**here, "vllm_gpu_memory_utilization": 0.2}) < planner.prior(here)
    planner.observe(0, here, "ok", None, 20.0, throughput=5.0)
    assert larger_share(Walk.of(planner, space, {}, [], set(), candidate_key), here, [(here, "ok")]) is None
