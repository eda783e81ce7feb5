"""Trading memory for a larger micro-batch (issue 19: runs still below 0.85 of the best possible
on the benchmark)."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import make_search

from autotune.search.walk import Walk
from autotune.study import candidate_key

ROOT = Path(__file__).resolve().parents[1]
PINS = {"use_vllm": False, "num_generations": 8, "zero_stage": 2, "offload": "optimizer"}


def pick(search, **values):
    return next(
        c
        for _, c in search.planner.pool(search.space, search.fixed, search.rules)
        if all(c.get(k) == v for k, v in values.items())
    )


def test_a_stuck_micro_batch_is_raised_with_a_memory_saver_on(tmp_path):
    """Seen: a VL 3B run on 4 x 40 GB exported micro-batch 1 without checkpointing at 0.80 of the
    best (micro 8 with checkpointing): micro 2 OOMed and checkpointing alone only cost speed, so no
    single step went there. Once the micro-batch's next step is ruled out, the trade is a saver on
    and the largest micro-batch nothing rules out; while that step is open, no trade."""
    from autotune.search.trade import next_trade

    search = make_search(tmp_path / "a", model="Qwen2.5-1.5B-Instruct", gpus=2, pins=PINS, global_batch=64)
    planner = search.planner
    here = pick(search, per_device_train_batch_size=1, gradient_checkpointing=False)
    up = pick(search, per_device_train_batch_size=2, gradient_checkpointing=False)
    planner.observe(1, here, "ok", None, 9.8, 2.0)  # as the model predicts: it stays as it is
    assert planner.predict(up) < search.recipe.gpu_memory_gib * (1 - search.recipe.headroom)
    assert (
        next_trade(Walk.of(planner, search.space, search.fixed, search.rules, set(), candidate_key), here)
        is None
    )
    planner.observe(2, up, "oom", "cuda", None)
    tried = {candidate_key(here), candidate_key(up)}
    trade = next_trade(Walk.of(planner, search.space, search.fixed, search.rules, tried, candidate_key), here)
    assert trade is not None
    assert trade["gradient_checkpointing"] is True and trade["per_device_train_batch_size"] >= 4, trade
    assert not planner.verdict(trade).skip


def test_a_trade_that_ran_is_not_repeated_smaller_one_that_ran_out_of_memory_is(tmp_path):
    """Each incumbent gets each trade once. Checkpointing on with micro 8 ran: the same trade with
    micro 4 would measure the same idea again (before this rule the share of benchmark runs at 0.95
    was 73%, with it 76%). Had micro 8 run out of memory, micro 4 is the trade's next try."""
    from autotune.search.trade import next_trade

    def stuck(folder):
        search = make_search(folder, model="Qwen2.5-1.5B-Instruct", gpus=2, pins=PINS, global_batch=64)
        here = pick(search, per_device_train_batch_size=1, gradient_checkpointing=False)
        up = pick(search, per_device_train_batch_size=2, gradient_checkpointing=False)
        search.planner.observe(1, here, "ok", None, 9.8, 2.0)
        search.planner.observe(2, up, "oom", "cuda", None)
        return search, here, {candidate_key(here), candidate_key(up)}

    for status, then in (("ok", None), ("oom", 4)):
        search, here, tried = stuck(tmp_path / status)
        trade = next_trade(
            Walk.of(search.planner, search.space, search.fixed, search.rules, tried, candidate_key), here
        )
        assert (trade["gradient_checkpointing"], trade["per_device_train_batch_size"]) == (True, 8), trade
        search.planner.observe(3, trade, status, "cuda" if status == "oom" else None, 15.8, 3.0)
        tried.add(candidate_key(trade))
        again = next_trade(
            Walk.of(search.planner, search.space, search.fixed, search.rules, tried, candidate_key), here
        )
        assert (again and again["per_device_train_batch_size"]) == then, again


def landscape_search(tmp_path, index):
    """A Search on the benchmark's landscape ``index`` (seed 0), as scripts/bench_search.py makes it."""
    import optuna

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_landscapes import build_landscape, make_recipe

    from autotune.progress import Reporter
    from autotune.runners import TrialContext
    from autotune.search.loop import Search
    from autotune.sim.families import landscape
    from autotune.study import StudyPaths

    land = build_landscape(landscape(index, 0), 30)
    recipe = make_recipe(land.case, index, 30)
    context = TrialContext(recipe, land.context.space, land.context.model, land.context.gpu)
    storage = optuna.storages.InMemoryStorage()
    return Search(
        recipe, StudyPaths(tmp_path, recipe.name), context, Reporter(30), storage=storage, report=False
    )


def test_a_knob_of_unknown_memory_effect_is_no_saver(tmp_path):
    """A trade needs a knob known to lower memory: the PPO trainer's colocate_all_models declares
    nothing, so flipping it proves nothing about the batch it could afford (adam_offload, declared
    'down', may be traded)."""
    from autotune.search.trade import next_trade

    search = landscape_search(tmp_path, 16)  # PPO 1.5B on 8 x 24 GB
    planner = search.planner
    here = pick(search, micro_train_batch_size=2, adam_offload=False, colocate_all_models=False)
    up = {**here, "micro_train_batch_size": 4}
    planner.observe(1, here, "ok", None, 15.0, 2.0)
    planner.observe(2, up, "oom", "cuda", None)
    tried = {candidate_key(here), candidate_key(up)}
    trade = next_trade(Walk.of(planner, search.space, search.fixed, search.rules, tried, candidate_key), here)
    assert trade is not None and trade["micro_train_batch_size"] > 2, trade
    assert trade["colocate_all_models"] is False, trade
    seen = set()
    while trade is not None:  # every trade it would make, best expected first
        assert trade["colocate_all_models"] is False, trade
        seen.add(
            next(k for k in ("adam_offload", "gradient_checkpointing", "zero_stage") if trade[k] != here[k])
        )
        tried.add(candidate_key(trade))
        trade = next_trade(
            Walk.of(planner, search.space, search.fixed, search.rules, tried, candidate_key), here
        )
    assert "adam_offload" in seen, seen


def test_a_vl_search_reaches_the_trade_its_prior_ranks_low():
    """The benchmark's VL 3B landscape #63 (seed 0): before, 0.80 of the best possible after 18
    trials, all at micro-batch 1 without checkpointing; the best is micro 8 with checkpointing.
    The walk must run the trade. Which of the near-ties it then exports is the choice under noise:
    since the landscape draws its steps' noise at twice its 8.2% run noise (the thirty-fifth pass
    of docs/benchmarks-notes.md), a lucky micro-batch-1 trial can win it (0/#63 is below 0.85 under
    two of the three draws in docs/benchmarks.md), a miss the report counts, not this test."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_search
    from bench_landscapes import build_landscape

    from autotune.sim.families import landscape

    land = build_landscape(landscape(63, 0), 30)
    run = bench_search.policy_autotune(land, 63, 30)
    assert run.measured / land.best >= 0.95, run.log


def test_a_plain_search_asks_the_saver_nobody_declared():
    """The benchmark's plain 8B on 8 x 80 GB, seed 2 #79, a trainer that logs no memory: micro-batch 8
    ran out of memory without activation offload, offload measured slower at micro-batch 4 and was
    never tried at 8 (0.81 of the best possible). The search's policy asks it
    (``trade.saver_experiment``) and the walk goes on from the copy that ran."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_search
    from bench_landscapes import build_landscape

    from autotune.sim.families import landscape

    land = build_landscape(landscape(79, 2), 30)
    run = bench_search.policy_autotune(land, 2079, 30)
    assert any("activation_offload=True" in line and "micro_batch_size=8 -> ok" in line for line in run.log)
    assert run.final / land.best >= 0.95, run.log


def test_the_seeds_cover_each_zero_stage_with_each_value_of_a_knob_of_unknown_memory_effect(tmp_path):
    """Seen on the benchmark (PPO 1.5B on 8 x 24 GB, 0.78 of the best): the seeds were the best per
    ZeRO stage, then the next by prior, and the prior cannot tell colocate_all_models' values apart,
    so no seed held the models colocated at ZeRO-3, where the best configurations are (all eight
    GPUs shard the actor); the walk reached that region at trial 27 of 30. A knob the model cannot
    weigh makes regions of its own: each ZeRO stage with each of its values gets a seed."""
    from autotune.search.seeds import SEEDS, seed_candidates

    search = landscape_search(tmp_path, 16)  # PPO 1.5B on 8 x 24 GB
    seeds = seed_candidates(search.planner, search.space, search.recipe, search.fixed, search.rules)
    regions = {(s["zero_stage"], s["colocate_all_models"]) for s in seeds}
    assert len(seeds) == SEEDS and regions == {(2, False), (2, True), (3, False), (3, True)}, seeds
