"""The simulated GRPO trainer: its ground-truth landscape and the fake trainer process.

The landscape is what rehearsals and benchmarks score against, so these tests pin its physics
(directions, not exact numbers) and the process contract the runner and monitor rely on.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.sim import Failure, SpecError, TrialTruth, evaluate

REPO = Path(__file__).resolve().parents[1]

QWEN7B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}
QWEN15B = {
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN3B = {
    "model_type": "qwen2",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
LLAMA8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
A100_80 = {
    "name": "A100-80GB",
    "memory_gib": 79.25,
    "tflops_bf16": 312,
    "bandwidth_tbs": 2.04,
    "interconnect_gbs": 300,
}
A100_40 = {
    "name": "A100-40GB",
    "memory_gib": 39.4,
    "tflops_bf16": 312,
    "bandwidth_tbs": 1.56,
    "interconnect_gbs": 300,
}
RTX4090 = {
    "name": "RTX-4090",
    "memory_gib": 23.6,
    "tflops_bf16": 165,
    "bandwidth_tbs": 1.0,
    "interconnect_gbs": 32,
}
H100 = {
    "name": "H100-80GB",
    "memory_gib": 79.3,
    "tflops_bf16": 989,
    "bandwidth_tbs": 3.35,
    "interconnect_gbs": 450,
}


def make_spec(
    model: dict = QWEN7B,
    gpu: dict = A100_80,
    gpus: int = 4,
    seed: int = 12345,
    max_steps: int = 6,
    host: float = 512,
    **params,
) -> dict:
    base = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "num_generations": 8,
        "zero_stage": 3,
        "offload": "none",
        "gradient_checkpointing": True,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.3,
        "vllm_enable_sleep_mode": False,
        "vllm_tensor_parallel_size": 1,
    }
    base.update(params)
    return {
        "params": base,
        "recipe": {
            "gpus": gpus,
            "max_prompt_length": 512,
            "max_completion_length": 1024,
            "beta": 0.0,
            "lora_rank": None,
            "host_memory_gib": host,
        },
        "model_config": model,
        "gpu": gpu,
        "seed": seed,
        "time_scale": 0.0002,
        "max_steps": max_steps,
    }


def grid(model: dict = QWEN7B, gpu: dict = A100_80, gpus: int = 4, max_steps: int = 8):
    """A coarse sweep of the default search space."""
    for b, z, off, u, sleep in itertools.product(
        [1, 2, 4, 8, 16, 32],
        [0, 1, 2, 3],
        ["none", "optimizer", "optimizer+params"],
        [0.2, 0.3, 0.4, 0.5, 0.6, 0.8],
        [False, True],
    ):
        if (off == "optimizer" and z < 2) or (off == "optimizer+params" and z < 3):
            continue
        params = dict(
            per_device_train_batch_size=b,
            zero_stage=z,
            offload=off,
            vllm_gpu_memory_utilization=u,
            vllm_enable_sleep_mode=sleep,
        )
        yield params, evaluate(make_spec(model, gpu, gpus, max_steps=max_steps, **params))


# ---------------------------------------------------------------------------------------------
# Landscape
# ---------------------------------------------------------------------------------------------


def test_7b_on_4xa100_has_oom_and_fitting_configs():
    results = list(grid())
    kinds = {t.failure.kind if t.failure else "ok" for _, t in results}
    assert {"ok", "cuda", "vllm_startup"} <= kinds
    # large micro-batches without ZeRO-3 do not fit
    for p, t in results:
        if p["zero_stage"] <= 1 and p["per_device_train_batch_size"] >= 16:
            assert t.failure is not None and t.failure.kind in ("cuda", "vllm_startup"), p
    # ZeRO-3 with a small batch and a moderate vLLM fraction fits
    for b in (2, 4, 8):
        t = evaluate(make_spec(per_device_train_batch_size=b, vllm_gpu_memory_utilization=0.3))
        assert t.ok, (b, t.failure)
        assert 40 < t.peak_gib < t.capacity_gib
    # the best fitting config is much faster than the median, and close to (not over) the limit
    ok = sorted((t.throughput(), t) for _, t in results if t.ok)
    thr = [x for x, _ in ok]
    best, median = thr[-1], thr[len(thr) // 2]
    assert best > 2.0 * median
    assert 0.8 * 79.25 < ok[-1][1].peak_gib < 79.25


def test_memory_grows_with_micro_batch():
    peaks = [
        evaluate(make_spec(per_device_train_batch_size=b, vllm_gpu_memory_utilization=0.2)).peak_gib
        for b in (1, 2, 4, 8)
    ]
    assert peaks == sorted(peaks) and peaks[-1] - peaks[0] > 5


def test_zero3_uses_less_memory_than_zero0():
    small = dict(model=QWEN15B, use_vllm=False, per_device_train_batch_size=2)
    z0 = evaluate(make_spec(zero_stage=0, **small))
    z1 = evaluate(make_spec(zero_stage=1, **small))
    z3 = evaluate(make_spec(zero_stage=3, **small))
    assert z0.ok and z1.ok and z3.ok
    # re-based on the H100 measurements: ZeRO 0 (DeepSpeed's bf16 optimizer) holds ~8 bytes per
    # parameter, ZeRO 1 keeps bf16 grads and its shard of the fp32 states (docs/gpu-validation.md)
    assert z3.peak_gib < z0.peak_gib - 4
    assert z3.peak_gib < z1.peak_gib - 4
    # and for 7B, ZeRO-0's states leave too little for anything else: it dies at start-up
    assert evaluate(make_spec(zero_stage=0)).failure.at_step == 0


def test_offload_lowers_gpu_memory_and_slows_steps():
    runs = [
        evaluate(make_spec(per_device_train_batch_size=4, offload=o))
        for o in ("none", "optimizer", "optimizer+params")
    ]
    assert all(t.ok for t in runs)
    peaks = [t.peak_gib for t in runs]
    steps = [t.steady_step_time() for t in runs]
    assert peaks[0] > peaks[1] > peaks[2]
    assert steps[0] < steps[1] < steps[2]


def test_first_steps_are_slow():
    t = evaluate(make_spec(max_steps=8))
    steady = sum(t.step_times[3:]) / len(t.step_times[3:])
    assert t.step_times[0] > 1.2 * steady
    assert t.step_times[1] > 1.0 * steady


def test_vllm_fraction_too_small_or_too_large():
    small = evaluate(make_spec(vllm_gpu_memory_utilization=0.12))
    assert small.failure is not None and small.failure.kind == "vllm_kv" and small.failure.at_step == 0
    large = evaluate(make_spec(vllm_gpu_memory_utilization=0.9))
    assert large.failure == Failure("vllm_startup", 0, "vllm_free_memory")
    # some KV cache, but not enough for one sequence of vLLM's max_model_len (the model's 32k context)
    spec = make_spec(vllm_gpu_memory_utilization=0.2)
    spec["recipe"]["vllm_max_model_length"] = 32768
    assert evaluate(spec).failure == Failure("vllm_kv", 0, "vllm_kv_max_seq")


def test_small_kv_cache_means_slower_generation():
    # 64 completions per GPU: at 0.2 the KV cache holds only a few sequences at a time
    few = evaluate(
        make_spec(
            per_device_train_batch_size=8,
            gradient_accumulation_steps=8,
            vllm_gpu_memory_utilization=0.2,
            vllm_enable_sleep_mode=True,
        )
    )
    many = evaluate(
        make_spec(
            per_device_train_batch_size=8,
            gradient_accumulation_steps=8,
            vllm_gpu_memory_utilization=0.5,
            vllm_enable_sleep_mode=True,
        )
    )
    assert few.ok and many.ok
    assert few.info["concurrency"] < many.info["concurrency"]
    assert few.info["gen_s"] > 2 * many.info["gen_s"]


def find_late_oom() -> tuple[dict, TrialTruth]:
    for p, t in grid(max_steps=10):
        if t.failure is not None and t.failure.kind == "cuda" and t.failure.at_step >= 3:
            return p, t
    raise AssertionError("no configuration dies late")


def test_near_capacity_configs_die_after_a_few_steps():
    _, t = find_late_oom()
    assert len(t.step_times) == t.failure.at_step - 1
    # the steps that ran were within a few percent of the capacity
    assert max(t.peak_memory_gib) > 0.95 * t.capacity_gib
    assert t.info["oom"]["free_gib"] < t.info["oom"]["tried_gib"]


def test_host_oom_with_offload_and_little_ram():
    assert evaluate(make_spec(offload="optimizer+params", host=64)).failure == Failure("host", 0, "sigkill")
    assert evaluate(make_spec(offload="optimizer+params", host=128)).failure == Failure("host", 1, "sigkill")
    assert evaluate(make_spec(offload="optimizer+params", host=512)).ok


def test_trl_config_checks():
    t = evaluate(make_spec(per_device_train_batch_size=3, gradient_accumulation_steps=1, gpus=2))
    assert t.failure == Failure("invalid", 0, "gen_batch_div_num_gen")
    t = evaluate(make_spec(vllm_tensor_parallel_size=3))
    assert t.failure == Failure("invalid", 0, "tp_divides_world")


def test_deterministic_per_seed():
    a, b = evaluate(make_spec(seed=7)), evaluate(make_spec(seed=7))
    assert a.step_times == b.step_times and a.peak_memory_gib == b.peak_memory_gib
    c = evaluate(make_spec(seed=8))
    assert c.step_times != a.step_times
    # noise, not a different landscape
    assert abs(c.throughput() - a.throughput()) / a.throughput() < 0.15


def test_other_scenarios_are_plausible():
    for model, gpu, gpus in ((QWEN15B, RTX4090, 2), (LLAMA8B, H100, 8), (QWEN3B, A100_40, 2)):
        results = list(grid(model, gpu, gpus, max_steps=5))
        ok = [t for _, t in results if t.ok]
        assert ok and len(ok) < len(results)
        assert all(t.peak_gib < gpu["memory_gib"] for t in ok)
        assert any(t.failure and t.failure.kind == "cuda" for _, t in results)


def test_evaluate_is_fast():
    specs = [
        make_spec(per_device_train_batch_size=b, vllm_gpu_memory_utilization=u, max_steps=20)
        for b in (1, 2, 4, 8)
        for u in (0.3, 0.4, 0.5, 0.6)
    ] * 20
    t0 = time.perf_counter()
    for s in specs:
        evaluate(s)
    per_call = (time.perf_counter() - t0) / len(specs)
    assert per_call < 0.002


def test_bad_specs_raise():
    with pytest.raises(SpecError):
        evaluate({"params": {}, "recipe": {"gpus": 1}, "gpu": A100_80})
    with pytest.raises(SpecError):
        evaluate(make_spec(offload="disk"))
    with pytest.raises(SpecError):
        evaluate({**make_spec(), "gpu": {"name": "x"}})


# ---------------------------------------------------------------------------------------------
# The trainer process
# ---------------------------------------------------------------------------------------------


def run_sim(tmp_path: Path, spec: dict, timeout: float = 20) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / "sim_spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "AUTOTUNE_TRIAL_DIR": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "AUTOTUNE_METRICS_FILE": str(tmp_path / "metrics.jsonl"),
    }
    return subprocess.run(
        [sys.executable, "-m", "autotune.sim", "--spec", str(spec_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def log_dicts(stdout: str) -> list[dict]:
    return [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{'")]


def test_process_success(tmp_path):
    spec = make_spec(per_device_train_batch_size=4, max_steps=5)
    truth = evaluate(spec)
    proc = run_sim(tmp_path, spec)
    assert proc.returncode == 0, proc.stderr
    dicts = log_dicts(proc.stdout)
    steps, summary = dicts[:-1], dicts[-1]
    assert len(steps) == 5
    assert [d["step_time"] for d in steps] == pytest.approx(truth.step_times, abs=1e-3)
    assert steps[0]["num_tokens"] == 4 * 4 * 4 * 1536
    assert {"loss", "grad_norm", "learning_rate", "completions/mean_length", "epoch"} <= steps[0].keys()
    assert set(summary) == {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_loss",
        "epoch",
    }
    assert summary["train_runtime"] == pytest.approx(sum(truth.step_times), rel=1e-3)
    assert "Maximum concurrency for 1,536 tokens per request" in proc.stdout
    assert "ZeRO stage 3" in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    assert all(x["samples"] == 64 and x["tokens"] == 64 * 1536 for x in lines)
    peaks = [x["peak_memory_gib"] for x in lines]
    assert peaks == sorted(peaks) and peaks[-1] == pytest.approx(truth.peak_gib, abs=0.01)


def test_process_without_metrics_file_and_str_logs(tmp_path):
    spec = {**make_spec(max_steps=2), "metrics_file": False, "log_style": "str"}
    proc = run_sim(tmp_path, spec)
    assert proc.returncode == 0
    assert not (tmp_path / "metrics.jsonl").exists()
    first = log_dicts(proc.stdout)[0]
    assert isinstance(first["step_time"], str) and float(first["step_time"]) > 0


def test_process_cuda_oom(tmp_path):
    proc = run_sim(tmp_path, make_spec(per_device_train_batch_size=32))
    assert proc.returncode == 1
    assert "Traceback (most recent call last):" in proc.stderr
    assert "transformers/models/qwen2/modeling_qwen2.py" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")
    assert "GPU 0 has a total capacity of 79.25 GiB of which" in last
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in last
    assert not log_dicts(proc.stdout)


def test_process_late_oom_logs_steps_first(tmp_path):
    params, truth = find_late_oom()
    proc = run_sim(tmp_path, make_spec(max_steps=10, **params))
    assert proc.returncode == 1
    assert len(log_dicts(proc.stdout)) == truth.failure.at_step - 1
    assert "CUDA out of memory" in proc.stderr


@pytest.mark.parametrize(
    "util,text",
    [
        (0.9, "on startup is less than desired GPU memory utilization (0.9, 71.33 GiB)"),
        (0.12, "No available memory for the cache blocks"),
    ],
)
def test_process_vllm_failures(tmp_path, util, text):
    proc = run_sim(tmp_path, make_spec(vllm_gpu_memory_utilization=util))
    assert proc.returncode == 1
    assert text in proc.stderr
    assert proc.stderr.strip().endswith(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    )


def test_process_host_oom_is_sigkill(tmp_path):
    proc = run_sim(tmp_path, make_spec(offload="optimizer+params", host=128, max_steps=3))
    assert proc.returncode == -signal.SIGKILL
    assert "Traceback" not in proc.stderr
    assert not log_dicts(proc.stdout)  # killed during step 1's optimizer step


def test_process_invalid_config(tmp_path):
    proc = run_sim(tmp_path, make_spec(per_device_train_batch_size=3, gradient_accumulation_steps=1, gpus=2))
    assert proc.returncode == 1
    assert "ValueError: generation_batch_size (6) must be divisible by num_generations (8)." in proc.stderr


def test_process_bad_spec(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.sim", "--spec", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    proc = run_sim(tmp_path, {"params": {}, "recipe": {"gpus": 2}})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_process_is_deterministic(tmp_path):
    spec = make_spec(max_steps=3, seed=99)
    a, b = run_sim(tmp_path, spec), run_sim(tmp_path, spec)
    assert log_dicts(a.stdout) == log_dicts(b.stdout)
    c = run_sim(tmp_path, make_spec(max_steps=3, seed=100))
    assert [d["step_time"] for d in log_dicts(c.stdout)[:-1]] != [
        d["step_time"] for d in log_dicts(a.stdout)[:-1]
    ]


def test_process_stops_on_sigterm(tmp_path):
    spec = {**make_spec(max_steps=50), "time_scale": 1.0}
    spec_file = tmp_path / "sim_spec.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune.sim", "--spec", str(spec_file)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == -signal.SIGTERM


# gpu.csv: what NVML would have shown, following the landscape
# ---------------------------------------------------------------------------------------------


def gpu_csv(tmp_path: Path) -> list[dict[str, str]]:
    import csv

    with open(tmp_path / "gpu.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def sim_summary(tmp_path: Path, spec: dict):
    from autotune.trial.utilization import phase_times, summarize_file

    return summarize_file(
        tmp_path / "gpu.csv",
        params=spec["params"],
        step_times=phase_times(tmp_path / "metrics.jsonl", after_step=2),
    )


def test_process_writes_gpu_csv_in_the_telemetry_format(tmp_path):
    from autotune.trial.telemetry import CSV_COLUMNS

    spec = make_spec(max_steps=6)
    truth = evaluate(spec)
    proc = run_sim(tmp_path, spec)
    assert proc.returncode == 0, proc.stderr
    assert tuple((tmp_path / "gpu.csv").read_text().splitlines()[0].split(",")) == CSV_COLUMNS
    rows = gpu_csv(tmp_path)
    assert {r["gpu"] for r in rows} == {"0", "1", "2", "3"} and len(rows) % 4 == 0
    phases = [r["phase"] for r in rows[::4]]
    assert phases == sorted(phases, key=["start", "warmup", "measure"].index) and set(phases) == {
        "start",
        "warmup",
        "measure",
    }
    # simulated seconds, up to the end of the last step (no sample of what did not happen)
    end = truth.startup_s + sum(truth.step_times)
    assert end - 5.0 <= float(rows[-1]["time_s"]) <= end
    measured_from = truth.startup_s + sum(truth.step_times[:2])
    assert all(float(r["time_s"]) >= measured_from - 1e-3 for r in rows if r["phase"] == "measure")
    # never more memory than the trial reported
    peak = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["peak_memory_gib"]
    assert max(float(r["mem_used_gib"]) for r in rows) <= peak + 1e-3
    assert {r["mem_total_gib"] for r in rows} == {"79.250"}
    summary = sim_summary(tmp_path, spec)
    assert summary.mean_gpu_util > 0.6 and not summary.low_util, summary


def test_offload_swings_and_is_diagnosed_while_the_same_run_without_it_is_not(tmp_path):
    spec = make_spec(max_steps=8, offload="optimizer")
    proc = run_sim(tmp_path / "off", spec)
    assert proc.returncode == 0, proc.stderr
    gpu0 = [
        float(r["util_pct"]) for r in gpu_csv(tmp_path / "off") if r["phase"] == "measure" and r["gpu"] == "0"
    ]
    assert max(gpu0) >= 85 and min(gpu0) <= 10  # generation waves and CPU Adam: a swing
    off = sim_summary(tmp_path / "off", spec)
    assert off.low_util and off.idle_share >= 0.3
    assert "offload=optimizer moves gradients and optimizer state over PCIe" in off.diagnosis
    # DeepSpeed's CPU Adam keeps the host's cores busy while the GPUs wait
    cpu = [
        float(r["host_cpu_pct"])
        for r in gpu_csv(tmp_path / "off")
        if r["gpu"] == "0" and r["phase"] == "measure"
    ]
    assert max(cpu) > 800

    plain = make_spec(max_steps=8)
    assert run_sim(tmp_path / "plain", plain).returncode == 0
    busy = sim_summary(tmp_path / "plain", plain)
    assert not busy.low_util and busy.mean_gpu_util > off.mean_gpu_util + 0.1


def test_sleep_mode_wake_ups_and_transformers_generate_show(tmp_path):
    base = make_spec(max_steps=6, vllm_gpu_memory_utilization=0.5, zero_stage=3)
    asleep = make_spec(
        max_steps=6, vllm_gpu_memory_utilization=0.5, zero_stage=3, vllm_enable_sleep_mode=True
    )
    shares = {}
    for name, spec in (("awake", base), ("asleep", asleep)):
        assert run_sim(tmp_path / name, spec).returncode == 0
        utils = [float(r["util_pct"]) for r in gpu_csv(tmp_path / name) if r["phase"] == "measure"]
        shares[name] = sum(u < 15 for u in utils) / len(utils)
    assert shares["asleep"] > shares["awake"]  # the GPUs wait through every wake-up
    hf = make_spec(max_steps=6, use_vllm=False)
    assert run_sim(tmp_path / "hf", hf).returncode == 0
    summary = sim_summary(tmp_path / "hf", hf)
    assert summary.low_util and "transformers' generate: enable use_vllm" in summary.diagnosis


def test_failed_trials_leave_what_nvml_would_have_seen(tmp_path):
    params, truth = find_late_oom()
    spec = make_spec(max_steps=10, **params)
    assert run_sim(tmp_path / "late", spec).returncode == 1
    rows = gpu_csv(tmp_path / "late")
    assert float(rows[-4]["mem_used_gib"]) >= 0.98 * truth.capacity_gib  # the GPU filled up
    assert run_sim(tmp_path / "early", make_spec(per_device_train_batch_size=32)).returncode == 1
    assert (tmp_path / "early" / "gpu.csv").exists()
    # a config TRL rejects never touches a GPU; a spec may turn the file off
    assert run_sim(tmp_path / "invalid", make_spec(num_generations=7)).returncode == 1
    assert not (tmp_path / "invalid" / "gpu.csv").exists()
    assert run_sim(tmp_path / "off", {**make_spec(max_steps=2), "gpu_csv": False}).returncode == 0
    assert not (tmp_path / "off" / "gpu.csv").exists()
