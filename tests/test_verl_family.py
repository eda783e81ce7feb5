"""The held-out verl-style family: its physics, its failures read by the real classifier, its
landscapes numbered apart from the report's, and the benchmark run on it alone."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from autotune.candidate.space_file import load_space
from autotune.sim.families import FAMILIES, HELD_OUT_BASE, landscape
from autotune.sim.family_base import failure_text
from autotune.sim.physics import Physics
from autotune.sim.replay import FamilyExecutor
from autotune.trial.classify import diagnose
from autotune.trial.control import StopRule, TrialControl

ROOT = Path(__file__).resolve().parents[1]
CASES = {landscape(HELD_OUT_BASE + k).name: HELD_OUT_BASE + k for k in range(4)}


def calm(index: int):
    """The landscape and its environment without noise or transient crashes."""
    d = landscape(index)
    return d, replace(d.env, physics=replace(d.physics, noise=0.0, crash_rate=0.0))


def base(**knobs) -> dict:
    return {
        "ppo_micro_batch_size_per_gpu": 2,
        "log_prob_micro_batch_size_per_gpu": 8,
        "enable_gradient_checkpointing": True,
        "param_offload": False,
        "optimizer_offload": False,
        "gpu_memory_utilization": 0.5,
        "tensor_model_parallel_size": 2,
        **knobs,
    }


def test_held_out_landscapes_are_numbered_apart_and_leave_the_report_s_unchanged():
    assert set(CASES) == {
        "verl 7B on 8 x 80 GB",
        "verl 3B on 4 x 24 GB",
        "verl 14B on 8 x 48 GB",
        "verl 1.5B on 4 x 40 GB",
    }
    assert all(landscape(i).family == "verl" for i in CASES.values())
    assert "verl" not in FAMILIES and all(landscape(i).family in FAMILIES for i in range(30))
    a, b = landscape(HELD_OUT_BASE, 0), landscape(HELD_OUT_BASE, 1)
    assert a.name == b.name and a.physics != b.physics  # the same case, its physics drawn anew
    assert landscape(HELD_OUT_BASE, 0) == a  # deterministic


def test_the_verl_space_loads_through_the_real_loader_with_what_its_user_declares():
    d = landscape(HELD_OUT_BASE)
    space = load_space(d.space)
    assert space.batch is not None and space.batch.micro_batch == "ppo_micro_batch_size_per_gpu"
    declared = {n: p.memory for n, p in space.params.items() if p.memory}
    assert declared == {
        "log_prob_micro_batch_size_per_gpu": "up",
        "enable_gradient_checkpointing": "down",
        "param_offload": "down",
        "optimizer_offload": "down",
        "gpu_memory_utilization": "up",
    }
    # every placeholder of the template is a knob of the space or a field autotune fills
    for name in space.params:
        assert "{" + name + "}" in d.recipe["command"]


def test_offloading_and_checkpointing_trade_speed_for_memory():
    """At a small engine share the training phase sets the peak (at a large one the rollout does)."""
    d, env = calm(CASES["verl 7B on 8 x 80 GB"])
    plain = d.truth(base(gpu_memory_utilization=0.3), env, 3, 6)
    assert plain.ok
    for knob in ("param_offload", "optimizer_offload"):
        off = d.truth(base(gpu_memory_utilization=0.3, **{knob: True}), env, 3, 6)
        assert off.ok and off.peak_gib < plain.peak_gib and off.steady_step_time() > plain.steady_step_time()
    no_ckpt = d.truth(base(gpu_memory_utilization=0.3, enable_gradient_checkpointing=False), env, 3, 6)
    assert no_ckpt.peak_gib > plain.peak_gib and no_ckpt.steady_step_time() < plain.steady_step_time()
    # FSDP gathers the weights for every micro-batch: a larger one is faster while it fits
    larger = d.truth(base(gpu_memory_utilization=0.3, ppo_micro_batch_size_per_gpu=4), env, 3, 6)
    assert larger.ok and larger.steady_step_time() < plain.steady_step_time()


def test_each_failure_reads_as_its_kind_through_the_real_classifier():
    """A CUDA OOM from the logits of a large micro-batch, vLLM refusing to start beside the actor's
    resident states, and vLLM finding no room for its cache where one GPU holds the 14B's weights."""
    d, env = calm(CASES["verl 3B on 4 x 24 GB"])
    cuda = d.truth(base(ppo_micro_batch_size_per_gpu=32, enable_gradient_checkpointing=False), env, 1, 6)
    startup = d.truth(base(gpu_memory_utilization=0.9), env, 1, 6)
    d14, env14 = calm(CASES["verl 14B on 8 x 48 GB"])
    kv = d14.truth(
        base(tensor_model_parallel_size=1, gpu_memory_utilization=0.4, param_offload=True), env14, 1, 6
    )
    for truth, env_, program, kind in (
        (cuda, env, d.program, "cuda"),
        (startup, env, d.program, "vllm_startup"),
        (kv, env14, d14.program, "vllm_kv"),
    ):
        assert truth.failure is not None and truth.failure.kind == kind, truth.failure
        verdict = diagnose(1, failure_text(truth, env_, program))
        assert (verdict.status, verdict.oom_kind) == ("oom", kind)
    # offloading the actor's states leaves vLLM room to start at a fraction it refused beside them
    refused = base(gpu_memory_utilization=0.7, log_prob_micro_batch_size_per_gpu=2)
    assert d.truth(refused, env, 1, 6).failure.kind == "vllm_startup"
    assert d.truth({**refused, "param_offload": True, "optimizer_offload": True}, env, 1, 6).ok


def test_a_verl_trial_runs_through_the_family_executor(tmp_path):
    d = landscape(CASES["verl 1.5B on 4 x 40 GB"])
    env = replace(d.env, physics=replace(d.physics, crash_rate=0.0))
    executor = FamilyExecutor(d.truth, env, d.program, seed=2, steps=0)
    fits = base(log_prob_micro_batch_size_per_gpu=2)
    outcome = executor(fits, tmp_path, 0, TrialControl(StopRule()))
    assert outcome.status == "ok" and outcome.throughput and outcome.peak_memory_gib, outcome
    crashing = replace(env, physics=Physics(crash_rate=1.0))
    crashed = FamilyExecutor(d.truth, crashing, d.program, seed=2, steps=0)(
        fits,
        tmp_path,
        1,
        TrialControl(StopRule(measure=8, adaptive=False)),  # past every crash step
    )
    assert crashed.status == "crash" and "Watchdog caught collective operation timeout" in failure_text(
        d.truth(fits, crashing, 1, 12), crashing, d.program
    )


def test_the_benchmark_runs_the_held_out_family_alone(tmp_path):
    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "bench_search.py"), *args],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )

    out = tmp_path / "benchmarks-heldout.md"
    run = bench(
        *["--landscapes", "2", "--families", "verl", "--trials", "8", "--policies", "autotune,random"],
        *["--out", str(out)],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {(r["landscape"], r["family"]) for r in rows} == {
        (HELD_OUT_BASE, "verl"),
        (HELD_OUT_BASE + 1, "verl"),
    }
    text = out.read_text()
    assert "held-out family `verl`" in text and "docs/benchmarks-heldout.json" in text
    assert f"#{HELD_OUT_BASE}" in text
    mixed = bench("--landscapes", "1", "--families", "plain,verl", "--out", str(tmp_path / "bad.md"))
    assert mixed.returncode == 2 and mixed.stdout.strip().splitlines() == [
        "error: --families plain,verl: the held-out verl is benchmarked alone: --families verl"
    ]
    assert "Traceback" not in mixed.stderr and not (tmp_path / "bad.md").exists()
