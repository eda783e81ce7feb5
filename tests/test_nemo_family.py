"""The held-out NeMo-RL-style family: numbered in a range of its own beside verl's, with every landscape
that was there before left as it was; its space through the real loader; each memory and speed trade
of its physics; its failures read by the real classifier; and the benchmark run on it alone."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from conftest import bench_script

from autotune.candidate.space_file import load_space
from autotune.configs.command import fill, template_fields
from autotune.sim import nemo
from autotune.sim.families import (
    FAMILIES,
    HELD_OUT,
    HELD_OUT_BASE,
    HELD_OUT_RANGE,
    held_out_base,
    held_out_family,
    landscape,
)
from autotune.sim.family_base import failure_text
from autotune.sim.physics import Physics
from autotune.sim.replay import FamilyExecutor
from autotune.trial.classify import diagnose
from autotune.trial.control import StopRule, TrialControl

ROOT = Path(__file__).resolve().parents[1]
NEMO = held_out_base("nemo")
CASES = {landscape(NEMO + k).name: NEMO + k for k in range(4)}


def calm(index: int, **physics: float):
    """The landscape and its environment without noise or transient crashes (and any physics given)."""
    d = landscape(index)
    return d, replace(d.env, physics=replace(d.physics, noise=0.0, crash_rate=0.0, **physics))


def base(**knobs) -> dict:
    return {
        "train_micro_batch_size": 2,
        "logprob_batch_size": 4,
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "sequence_parallel": True,
        "activation_checkpointing": True,
        "recompute_granularity": "full",
        "optimizer_cpu_offload": False,
        "gpu_memory_utilization": 0.6,
        **knobs,
    }


def step(d, env, **knobs) -> float:
    truth = d.truth(base(**knobs), env, 3, 8)
    assert truth.ok, (knobs, truth.failure)
    return truth.steady_step_time()


def fingerprint(index: int, seed: int) -> str:
    """A landscape's whole definition, without the checkout's absolute paths."""
    d = landscape(index, seed)
    body = [d.index, d.family, d.name, d.physics.to_json(), d.space.name if d.space else None, d.recipe]
    body += [asdict(d.env) if d.env else None, d.drawn]
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


# taken from the code before nemo was added (git HEAD then): rotation's trl, ppo and plain and verl's
BEFORE = {
    "0/0": "d8da154336c9e0b8",
    "0/4": "9134d902ea09a552",
    "0/7": "9ed75f25fe03d442",
    "0/1000": "9e1eb63d305e97f3",
    "0/1003": "5d97665d463a039d",
    "0/1049": "fa859120b128ec55",
    "0/1999": "442d474727fd1c5e",
    "1/1001": "7f650f4c0d7e2816",
    "1/1002": "1b1d74d7fc324c4f",
}


def test_nemo_is_numbered_apart_and_every_landscape_before_it_is_unchanged():
    assert HELD_OUT == ("verl", "nemo") and NEMO == HELD_OUT_BASE + HELD_OUT_RANGE == 2000
    assert set(CASES) == {
        "nemo 8B on 8 x 80 GB",
        "nemo 3B on 4 x 24 GB",
        "nemo 32B on 8 x 80 GB",
        "nemo 7B on 8 x 48 GB",
    }
    assert [held_out_family(i) for i in (999, 1000, 1999, 2000, 2999, 3000)] == [
        *(None, "verl", "verl", "nemo", "nemo", None)
    ]
    assert all(landscape(i).family == "nemo" for i in (*CASES.values(), NEMO + 999))
    assert landscape(NEMO - 1).family == "verl" and "nemo" not in FAMILIES
    with pytest.raises(ValueError, match="past the held-out"):
        landscape(NEMO + HELD_OUT_RANGE)
    runs = {k: (int(k.partition("/")[2]), int(k.partition("/")[0])) for k in BEFORE}
    assert {k: fingerprint(index, seed) for k, (index, seed) in runs.items()} == BEFORE
    a, b = landscape(NEMO, 0), landscape(NEMO, 1)
    assert a.name == b.name and a.physics != b.physics and landscape(NEMO, 0) == a
    no_logs = sum(not landscape(NEMO + k).env.logs_memory for k in range(200)) / 200
    assert 0.1 < no_logs < 0.3  # about a fifth log no memory, as verl's


def test_search_seeds_keep_the_rotation_s_and_verl_s_and_give_nemo_its_own():
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_search import APART, search_seed

    assert [search_seed(3, i, 2) for i in (5, 1000, 1999)] == [2003005, 1002003000, 1002003999]
    nemo_seeds = {search_seed(s, NEMO + i, luck) for s in (0, 999) for i in (0, 999) for luck in (0, 999)}
    others = {search_seed(s, i, luck) for s in (0, 999) for i in (0, 999, 1000, 1999) for luck in (0, 999)}
    assert not nemo_seeds & others and min(nemo_seeds) == 2 * APART**3 and max(nemo_seeds) < 2**32


def test_the_nemo_space_loads_through_the_real_loader_and_fills_its_template():
    d = landscape(NEMO)
    space = load_space(d.space)
    assert space.batch is not None and space.batch.micro_batch == "train_micro_batch_size"
    assert {n: p.memory for n, p in space.params.items() if p.memory} == {
        "logprob_batch_size": "up",
        "tensor_model_parallel_size": "down",
        "pipeline_model_parallel_size": "down",
        "sequence_parallel": "down",
        "activation_checkpointing": "down",
        "optimizer_cpu_offload": "down",
        "gpu_memory_utilization": "up",
    }
    tokens, _ = template_fields(d.recipe["command"])
    recipe_fields = {"model": "m", "gpus": 8, "global_batch": 512, "max_completion_length": 1024}
    filled = " ".join(fill(tokens, {**base(), **recipe_fields, "max_steps": 5, "trial_dir": "/t"}))
    for name, value in base().items():
        assert "{" + name + "}" in d.recipe["command"] and f"={str(value).lower()}" in filled.lower()
    assert f"vllm_cfg.tensor_parallel_size={int(d.env.extra['vllm_tp'])}" in filled


def test_tensor_parallelism_shards_states_but_its_all_reduces_cost_far_more_over_pcie():
    d, env = calm(CASES["nemo 8B on 8 x 80 GB"])
    assert nemo.states(env, base(tensor_model_parallel_size=1, sequence_parallel=False)) > 1.5 * nemo.states(
        env, base()
    )
    # the distributed optimizer's 12/DP bytes a parameter are the same whatever TP is: only 6 shrink
    for tp in (1, 2, 4, 8):
        knobs = base(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
        optimizer = nemo.states(env, knobs) - 6.0 * nemo.stage_params(env, tp, 1) * env.physics.mem_states
        assert optimizer == pytest.approx(12.0 * 8e9 / 8 * env.physics.mem_states, rel=1e-9)
    off = {"optimizer_cpu_offload": True}  # the 7B at TP 2 fits only so
    nvlink = step(d, env, tensor_model_parallel_size=4, **off) / step(d, env, **off)
    d7, env7 = calm(CASES["nemo 7B on 8 x 48 GB"])
    pcie = step(d7, env7, tensor_model_parallel_size=4, **off) / step(d7, env7, **off)
    assert 1.0 < nvlink < 1.1 < pcie
    # sequence parallelism shards the layer norms' and dropouts' activations and costs nothing
    sp_on, sp_off = (
        base(activation_checkpointing=False),
        base(activation_checkpointing=False, sequence_parallel=False),
    )
    assert nemo.layer_bytes(env, sp_off, 4096) > 1.15 * nemo.layer_bytes(env, sp_on, 4096)
    assert nemo.layer_bytes(env, base(sequence_parallel=False), 4096) == 2 * nemo.layer_bytes(
        env, base(), 4096
    )
    assert step(d, env, sequence_parallel=False) >= step(d, env)
    # Qwen2.5-7B has 28 heads: TP 8 is refused; TP 4 is not
    assert "num_attention_heads (28)" in nemo.refusal(env7, base(tensor_model_parallel_size=8))
    assert nemo.refusal(env7, base(tensor_model_parallel_size=4)) is None


def test_pipeline_stages_save_weights_not_the_first_stage_s_activations_and_idle_in_a_bubble():
    d, env = calm(CASES["nemo 8B on 8 x 80 GB"])
    one, four = base(), base(pipeline_model_parallel_size=4)
    assert nemo.stage_params(env, 2, 4) < 0.35 * nemo.stage_params(env, 2, 1)
    assert nemo.states(env, four) < 0.6 * nemo.states(env, one)  # the optimizer's 12/DP stay
    # 1F1B: the first stage holds p micro-batches of L/p layers each, the whole model's worth
    tokens = 2 * (env.prompt + env.completion)
    kept_all = base(pipeline_model_parallel_size=4, activation_checkpointing=False)
    whole = env.layers * nemo.layer_bytes(env, kept_all, tokens)
    assert nemo.training_peak(env, kept_all) == pytest.approx(whole)
    # the bubble (p-1)/(m+p-1) grows as a larger micro-batch leaves fewer of them
    small = replace(env, global_batch=32)
    gain_pp1 = step(d, small, train_micro_batch_size=8) / step(d, small, train_micro_batch_size=1)
    gain_pp4 = step(d, small, train_micro_batch_size=8, pipeline_model_parallel_size=4) / step(
        d, small, train_micro_batch_size=1, pipeline_model_parallel_size=4
    )
    assert nemo.micro_batches(small, base(train_micro_batch_size=8, pipeline_model_parallel_size=4), 8) <= 4
    assert gain_pp4 > gain_pp1 + 0.02  # a micro-batch of 8 pays at PP 1; at PP 4 its bubble eats the gain


def test_recomputation_and_the_optimizer_s_offload_trade_time_for_memory():
    d, env = calm(CASES["nemo 7B on 8 x 48 GB"])
    none, selective, full = (
        base(activation_checkpointing=False),
        base(recompute_granularity="selective"),
        base(),
    )
    peaks = [nemo.training_peak(env, k) for k in (none, selective, full)]
    assert peaks[0] > peaks[1] > peaks[2]
    d8, env8 = calm(CASES["nemo 8B on 8 x 80 GB"])
    times = [step(d8, env8, **k) for k in (none, selective, full)]
    assert times[0] < times[1] < times[2]
    # the granularity does nothing without the checkpointing (NeMo-RL reads it only then)
    off = d8.truth(base(activation_checkpointing=False, recompute_granularity="selective"), env8, 3, 8)
    assert off.steady_step_time() == pytest.approx(d8.truth(none, env8, 3, 8).steady_step_time(), rel=1e-12)
    # the moments on the host: less memory; slower where the host's Adam is slow, faster where it is
    # quick enough to beat the optimizer's trip to the host and back that the colocated step makes
    assert nemo.states(env, base(optimizer_cpu_offload=True)) < nemo.states(env, base())
    slow = replace(env8, extra={**env8.extra, "cpu_adam": 0.2e9})
    quick = replace(env8, extra={**env8.extra, "cpu_adam": 2e9})
    for machine, slower in ((slow, True), (quick, False)):
        assert (step(d8, machine, optimizer_cpu_offload=True) > step(d8, machine)) is slower


def test_micro_batches_and_the_engine_s_share_trade_speed_for_memory():
    d, env = calm(CASES["nemo 8B on 8 x 80 GB"])
    assert step(d, env, train_micro_batch_size=4) < step(d, env)
    assert nemo.training_peak(env, base(train_micro_batch_size=4)) > nemo.training_peak(env, base())
    assert step(d, env, logprob_batch_size=16) < step(d, env, logprob_batch_size=2)
    assert nemo.logprob_peak(env, base(logprob_batch_size=16)) == pytest.approx(
        4 * nemo.logprob_peak(env, base())
    )
    # more cache, fewer waves of the rollout, until one wave holds them all; the rollout's peak grows
    times = [step(d, env, gpu_memory_utilization=u) for u in (0.3, 0.4, 0.5, 0.8)]
    assert times[0] > times[1] > times[2] == times[3]
    peaks = [d.truth(base(gpu_memory_utilization=u), env, 3, 8).peak_gib for u in (0.5, 0.8)]
    assert peaks[1] > peaks[0] + 0.25 * env.gpu_gib


def test_each_failure_reads_as_its_kind_through_the_real_classifier():
    """A CUDA OOM loading the 32B's states on too few shards, and one in the update of a micro-batch too
    large; vLLM refusing a share above what its start-up finds free, and finding no room for its cache
    beside the 32B's weights; a layout the trainer refuses, which reads as no OOM."""
    d32, env32 = calm(CASES["nemo 32B on 8 x 80 GB"])
    d3, env3 = calm(CASES["nemo 3B on 4 x 24 GB"], free_margin=0.9)
    loading = d32.truth(base(), env32, 1, 6)
    updating = d3.truth(base(train_micro_batch_size=8, activation_checkpointing=False), env3, 1, 6)
    startup = d3.truth(base(gpu_memory_utilization=0.9), env3, 1, 6)
    kv = d32.truth(base(gpu_memory_utilization=0.3), env32, 1, 6)
    assert loading.failure.at_step == 0 and updating.failure.at_step == 1
    for truth, env_, kind in (
        (loading, env32, "cuda"),
        (updating, env3, "cuda"),
        (startup, env3, "vllm_startup"),
        (kv, env32, "vllm_kv"),
    ):
        assert truth.failure is not None and truth.failure.kind == kind, truth.failure
        verdict = diagnose(1, failure_text(truth, env_, nemo.PROGRAM))
        assert (verdict.status, verdict.oom_kind) == ("oom", kind)
    refused = {
        "World size (4) is insufficient": base(tensor_model_parallel_size=4, pipeline_model_parallel_size=2),
        "Cannot use sequence parallelism without tensor parallelism": base(tensor_model_parallel_size=1),
    }
    for words, knobs in refused.items():
        truth = d3.truth(knobs, env3, 1, 6)
        assert truth.failure.kind == "invalid" and truth.failure.at_step == 0
        verdict = diagnose(1, failure_text(truth, env3, nemo.PROGRAM))
        assert verdict.status != "oom" and words in verdict.error_line
    # on more shards the 32B loads, and its engine gets its cache at a larger share
    assert d32.truth(base(tensor_model_parallel_size=8, optimizer_cpu_offload=True), env32, 1, 6).ok


def test_a_nemo_trial_runs_through_the_family_executor(tmp_path):
    d = landscape(CASES["nemo 8B on 8 x 80 GB"])
    env = replace(d.env, physics=replace(d.physics, crash_rate=0.0))
    executor = FamilyExecutor(d.truth, env, d.program, seed=2, steps=0)
    outcome = executor(base(), tmp_path, 0, TrialControl(StopRule()))
    assert outcome.status == "ok" and outcome.throughput and outcome.peak_memory_gib, outcome
    silent = replace(env, logs_memory=False)
    quiet = FamilyExecutor(d.truth, silent, d.program, seed=2, steps=0)(
        base(), tmp_path, 1, TrialControl(StopRule())
    )
    assert quiet.status == "ok" and quiet.peak_memory_gib is None
    crashing = replace(env, physics=Physics(crash_rate=1.0))
    crashed = FamilyExecutor(d.truth, crashing, d.program, seed=2, steps=0)(
        base(), tmp_path, 2, TrialControl(StopRule(measure=8, adaptive=False))
    )
    assert crashed.status == "crash"


def bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return bench_script("bench_search.py", *args, cwd=tmp_path)


def test_the_benchmark_runs_nemo_alone_and_refuses_it_mixed_or_past_its_range(tmp_path):
    out = tmp_path / "benchmarks-heldout-nemo.md"
    run = bench(
        tmp_path,
        *["--landscapes", "2", "--families", "nemo", "--trials", "8", "--policies", "autotune,random"],
        *["--out", str(out)],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {(r["landscape"], r["family"]) for r in rows} == {(NEMO, "nemo"), (NEMO + 1, "nemo")}
    text = out.read_text()
    assert "held-out family `nemo`" in text and "held-out family `verl`" not in text and f"#{NEMO}" in text
    # the command it says produced it writes this file again, not docs/benchmarks.md
    assert "--jobs 1 --out docs/benchmarks-heldout-nemo.md` (" in text
    for families in ("trl,nemo", "verl,nemo"):
        mixed = bench(
            tmp_path, "--landscapes", "1", "--families", families, "--out", str(tmp_path / "bad.md")
        )
        held = families.split(",")[-1] if families.startswith("trl") else "verl"
        assert mixed.returncode == 2 and mixed.stdout.strip().splitlines() == [
            f"error: --families {families}: the held-out {held} is benchmarked alone: --families {held}"
        ]
    past = bench(tmp_path, "--landscapes", str(HELD_OUT_RANGE + 1), "--families", "nemo", "--out", "x.md")
    assert past.returncode == 2 and "too many of --families nemo" in past.stdout
    assert "Traceback" not in mixed.stderr + past.stderr and not (tmp_path / "bad.md").exists()


def test_bench_inspect_replays_a_nemo_run_and_refuses_one_past_the_ranges():
    def inspect(name: str) -> subprocess.CompletedProcess:
        return bench_script("bench_inspect.py", name, "--trials", "6")

    run = inspect(f"0/{NEMO}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"0/#{NEMO} nemo nemo 8B on 8 x 80 GB: best possible")
    assert "launched trials" in run.stdout and "exported:" in run.stdout
    past = inspect(f"0/{NEMO + HELD_OUT_RANGE}")
    assert past.returncode == 2 and past.stdout.strip().splitlines() == [
        f"error: 0/{NEMO + HELD_OUT_RANGE}: landscape {NEMO + HELD_OUT_RANGE}: past the held-out families' ranges"
    ]


def test_a_layout_the_trainer_refuses_is_not_launched_again_after_two_alike_crashes():
    """A crash answers nothing about memory, so a candidate that crashed stayed open to every
    proposer: on 0/#2003 (7B, whose 28 heads TP 8 does not divide, which the space cannot say) the walk
    launched one refused layout fifteen times and exported 0.68 of the best. Twice with the same
    error, the crash is the candidate's own (study.record.crashed_alike)."""
    run, land = search(NEMO + 3)
    crashes: dict[str, int] = {}
    for r in run.trials:
        if r.status == "crash":
            key = json.dumps(r.params, sort_keys=True)
            crashes[key] = crashes.get(key, 0) + 1
    assert crashes and max(crashes.values()) <= 2, crashes


def test_a_value_the_trainer_refused_by_name_is_not_launched_again_in_other_settings():
    """Closing a candidate after two alike crashes left the refused value open in every other
    setting: on 0/#2007 (7B, 28 heads) the pool proposed TP 8 with one knob or another changed nine
    times of thirty, each refused at start-up in Megatron-Core's words, which name the knob and its
    value (search/refusals.py)."""
    run, land = search(NEMO + 7)
    tp8 = [r.status for r in run.trials if r.params["tensor_model_parallel_size"] == 8]
    assert tp8 == ["crash"], tp8
    assert run.exported is not None


def test_a_layout_the_space_s_rules_forbid_is_never_launched():
    """The space states Megatron's rules (TP x PP divides the GPUs, sequence parallelism needs TP); on
    0/#2002 (32B on 8 x 80 GB) the leanest step went to TP 8 x PP 4 and every trial after it crashed
    or ran out of memory, nothing exported, before a space could state them."""
    run, land = search(NEMO + 2)
    for r in run.trials:
        p = r.params
        assert 8 % (p["tensor_model_parallel_size"] * p["pipeline_model_parallel_size"]) == 0, p
        assert p["tensor_model_parallel_size"] > 1 or not p["sequence_parallel"], p
    assert run.exported is not None and run.final > 0.5 * land.best


def test_the_pool_stops_spending_a_third_of_the_search_on_its_ooms():
    """The memory model cannot read Megatron's knobs, so the grid's best open candidate is the speed
    prior's fastest (the largest micro-batch) with one saver more each time: on 0/#2005 all ten of
    the pool's trials ran out of memory, a third of the search. After an OOM in a row it takes fewer
    turns (policy.pool_pays)."""
    run, land = search(NEMO + 5)
    pool = [r.status for r in run.trials if r.proposer == "pool"]
    assert pool.count("oom") <= 4, pool
    assert sum(r.status == "ok" for r in run.trials) >= 10 and run.exported is not None


def test_a_switch_nothing_describes_is_run_at_each_of_its_values():
    """Neither the memory side nor the speed prior reads ``recompute_granularity``, so every ranking
    tied it and the rotation of knobs never gave it a turn: on 0/#2000 (8B on 8 x 80 GB) no trial of
    eighteen ran selective recomputation, which the best configurations share, and the search stopped
    converged at 0.91 of the best possible (search/coverage.py). With selective run it reaches 0.98;
    with vLLM's share raised where it would stop, three more trials of one configuration at 0.94 let
    a lucky run of it win (0.94), which is still above what it stopped at without selective."""
    run, land = search(NEMO)
    assert any(r.status == "ok" and r.params.get("recompute_granularity") == "selective" for r in run.trials)
    assert run.final >= 0.93 * land.best


def test_vllm_s_share_is_raised_while_the_measured_peak_leaves_room_for_it():
    """NeMo-RL's engine sleeps while the policy trains, so its share moves no measured peak until the
    rollout's own does, and the speed prior reads no share of a trainer it does not describe. On
    0/#2104 (8B on 8 x 80 GB) one step from 0.6 to 0.7 ran no faster (the rollout still took as many
    waves), nothing went on, and the search stopped converged at 0.71 of the best possible, whose
    share is 0.8 (search/coverage.larger_share)."""
    run, land = search(NEMO + 104)
    assert any(r.status == "ok" and r.params["gpu_memory_utilization"] >= 0.8 for r in run.trials)
    assert run.final >= 0.95 * land.best


def converging(tmp_path):
    """A search of 0/#2000 opened on a real in-memory study, its default as the best, and a way to
    record a trial that ran (its peak as given) in the study's rows and the planner."""
    import optuna

    from autotune.runners import TrialContext
    from autotune.search.loop import Search
    from autotune.study import StudyPaths, candidate_key
    from autotune.study.record import record
    from autotune.trial.outcome import Outcome, Status

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_landscapes import Quiet, build_landscape, make_recipe

    land = build_landscape(landscape(NEMO, 0), 30)
    recipe = make_recipe(land.case, 0, 30)
    context = TrialContext(recipe, land.context.space, land.context.model, land.context.gpu)
    search = Search(
        recipe,
        StudyPaths(tmp_path, recipe.name),
        context,
        Quiet(30),
        storage=optuna.storages.InMemoryStorage(),
    )
    state = search.open()
    best = search.space.normalize(search.space.defaults())  # checkpointing on, full recomputation

    def ran(params: dict, throughput: float, peak: float) -> None:
        outcome = Outcome(Status.OK, throughput=throughput, peak_memory_gib=peak, steps=5, wall_time_s=1.0)
        key = candidate_key(params)
        record(state.study, state.study.ask(), params, outcome, launched=True, key=key)
        search.planner.observe(len(search.planner.seen), params, "ok", None, peak, throughput)

    search._converged = lambda launched: "converged (as the stops would say)"
    return search, best, ran


def test_no_convergence_stop_fires_while_such_a_value_is_unsettled(tmp_path):
    """Every stop "nothing untried beats the best" (the patience stop, the measured local optimum, the
    prior's word) says nothing of a switch nothing describes: ``Search.converged`` holds each of them
    back until each value of it has run (search/coverage.py), read from the study's own rows. (Peaks
    at the limit leave no room to raise vLLM's share: the next test.)"""
    search, best, ran = converging(tmp_path)
    ran(best, 10.0, 75.0)
    ran({**best, "train_micro_batch_size": 2}, 9.0, 75.0)
    assert search.converged(20) is None
    ran({**best, "recompute_granularity": "selective", "train_micro_batch_size": 2}, 9.5, 75.0)
    assert search.converged(20) == "converged (as the stops would say)"


def test_where_the_search_would_stop_the_walk_raises_vllm_s_share_while_the_peak_has_room(tmp_path):
    """Where every value of the switches has run and the stops would fire, the search goes on while
    vLLM's share can rise inside the measured peak's room, and the walk's next step is that share
    (search/coverage.larger_share); never before, where it crowded out the walk's own steps."""
    search, best, ran = converging(tmp_path)
    ran(best, 10.0, 60.0)  # 15 GiB of room on 79.3 GiB cards (limit 75.3): 0.6 -> 0.7, not 0.8
    ran({**best, "recompute_granularity": "selective"}, 9.5, 60.0)
    sampler = search.state.study.sampler
    assert sampler.local(search.state.study) != {**best, "gpu_memory_utilization": 0.7}  # not settling
    assert search.converged(20) is None and sampler.settling
    assert sampler.local(search.state.study) == {**best, "gpu_memory_utilization": 0.7}
    assert not sampler.settling  # one raise for each stop held back
    ran({**best, "gpu_memory_utilization": 0.7}, 10.0, 60.0)  # its peak did not move
    assert search.converged(20) is None
    assert sampler.local(search.state.study) == {**best, "gpu_memory_utilization": 0.8}
    ran({**best, "gpu_memory_utilization": 0.8}, 10.0, 68.0)  # it did: 7.3 GiB of room, not 8
    assert search.converged(20) == "converged (as the stops would say)"
    assert not sampler.settling  # a search that goes on after its stop walks before it raises


def test_in_the_last_launches_the_walk_raises_vllm_s_share_though_no_stop_would_fire(tmp_path):
    """Most searches of this family end at --trials, never held at a stop (62 of seed 0's 105): their
    last CLOSING launches raise vLLM's share as a held stop does (search/coverage.closing), the one step
    whose sign is known, and not before. The study's launches are counted, running claims included
    (under --parallel the slots hold launches not yet told)."""
    from autotune.search.coverage import CLOSING
    from autotune.study.claims import LAUNCHING

    search, best, ran = converging(tmp_path)
    search._converged = lambda launched: None  # no stop would fire
    ran(best, 10.0, 60.0)  # 15 GiB of room: 0.6 -> 0.7
    ran({**best, "recompute_granularity": "selective"}, 9.5, 60.0)
    sampler, study = search.state.study.sampler, search.state.study
    raised = {**best, "gpu_memory_utilization": 0.7}
    search.recipe.trials = 2 + CLOSING + 1  # two launched: one launch before the last ones
    assert search.converged(2) is None and not sampler.settling
    assert sampler.local(study) != raised
    study.ask().set_user_attr(LAUNCHING, True)  # a third, running in another slot
    assert search.converged(2) is None and sampler.settling
    assert sampler.local(study) == raised
    assert not sampler.settling  # one raise, then the stop is asked again


def search(index: int):
    """One autotune search of a nemo landscape as the benchmark runs it (seed 0, 30 trials)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_landscapes import build_landscape
    from bench_search import policy_autotune, search_seed

    land = build_landscape(landscape(index, 0), 30)
    return policy_autotune(land, search_seed(0, index, 0), 30), land


def test_crashed_alike_needs_two_crashes_of_one_candidate_with_one_error():
    """Read from a real Optuna study as ``record`` leaves it: one crash, two with different errors
    (a hiccup, then the refusal) or two of a known transient class (an NCCL timeout twice) keep a
    candidate open; two with the same error, numbers apart (a Ray worker's pid), close it, and it is
    then answered from the study like a measured one."""
    import optuna

    from autotune.study.record import crashed_alike, measured_configs, record
    from autotune.trial.outcome import Outcome, Status

    study = optuna.create_study(direction="maximize")
    refused = "ValueError: Cannot use sequence parallelism without tensor parallelism"
    nccl = "terminate called after throwing an instance of 'c10::DistBackendError'"

    def crash(key: str, error: str) -> None:
        record(
            study, study.ask(), {"x": key}, Outcome(Status.CRASH, error_line=error), launched=True, key=key
        )

    for key, error in [
        ("a", refused),
        ("b", refused),
        ("b", nccl),
        ("c", f"(pid=41, ip=10.0.0.2) {refused}"),
    ]:
        crash(key, error)
    crash("d", nccl)
    crash("d", nccl)
    assert crashed_alike(study) == {} and measured_configs(study) == {}
    crash("c", f"(pid=97, ip=10.0.0.3) {refused}")
    assert set(crashed_alike(study)) == {"c"} and set(measured_configs(study)) == {"c"}
