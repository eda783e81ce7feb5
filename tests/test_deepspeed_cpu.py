"""Real DeepSpeed ZeRO on CPU: accelerate + DeepSpeed 0.19 with gloo, CPU Adam offload, 1 and 2
processes, real TRL GRPO with tiny-qwen; and a real CPU search pinned to ZeRO-3 + optimizer offload.

DeepSpeed builds its CPU ops (cpu_adam, shm_comm) on first use, a few minutes once per machine
(cached in ~/.cache/torch_extensions); :func:`deepspeed_ops` builds them once, before the first
trial, so no trial's hang timeout counts a compiler.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

pytest.importorskip("deepspeed", reason="DS_BUILD_OPS=0 pip install -e '.[test]' installs it")

from autotune.candidate.space_file import load_space  # noqa: E402
from autotune.hardware import find_gpu_type  # noqa: E402
from autotune.models import resolve_model  # noqa: E402
from autotune.runners.base import TrialContext  # noqa: E402
from autotune.runners.trl import TrlRunner  # noqa: E402
from autotune.trial.launch import launch  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT, COMPLETION = 32, 16

BUILD = (
    "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
    "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
    "CPUAdamBuilder().load(); ShareMemCommBuilder().load(); print('built')\n"
)


STALE_BATON_S = 20 * 60  # a build takes about 3 minutes idle, 15 on a loaded 2-core machine


def clear_stale_batons() -> None:
    """Remove build locks left by a killed build: torch waits on them for ever otherwise.

    torch's extension builder guards each build folder with a ``lock`` file that a killed build
    never removes; the next build then waits on it until a test's timeout. A lock older than any
    real build is such a leftover."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for baton in root.glob("**/lock"):
        if time.time() - baton.stat().st_mtime > STALE_BATON_S:
            baton.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def deepspeed_ops():
    """cpu_adam and shm_comm JIT-built (or loaded from the cache) once for the whole module."""
    clear_stale_batons()
    done = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "built" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def engine_line(stdout: str) -> str:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("autotune: engine:")]
    return line


@pytest.mark.parametrize(
    "stage,offload,processes",
    [
        (3, "optimizer", 2),  # the seeds' setup: ZeRO-3 + CPU Adam, data parallel over gloo
        (3, "optimizer+params", 1),
        (2, "optimizer", 1),
        (1, "none", 2),
    ],
)
def test_real_zero_trial_on_cpu(deepspeed_ops, recipe_factory, tmp_path, stage, offload, processes):
    recipe = recipe_factory(
        model="tiny-qwen",
        gpus=processes,
        runner="trl",
        device="cpu",
        max_prompt_length=PROMPT,
        max_completion_length=COMPLETION,
        warmup_steps=1,
        measure_steps=1,
    )
    runner = TrlRunner(
        TrialContext(
            recipe=recipe,
            space=load_space(),
            model=resolve_model(recipe.model),
            gpu=find_gpu_type(recipe.gpu_type),
        )
    )
    runner.check()
    params = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_generations=2,
        gradient_checkpointing=True,
        use_vllm=False,
        zero_stage=stage,
        offload=offload,
    )
    assert runner.forced() == {"use_vllm": False}
    assert all(rule(params) is None for rule in runner.rules())
    trial_dir = tmp_path / "trial"
    spec = runner.prepare(params, trial_dir, 0)
    assert "--multi_gpu" not in spec.argv and "accelerate.commands.launch" in spec.argv
    accelerate = yaml.safe_load((trial_dir / "accelerate_config.yaml").read_text())
    assert accelerate["distributed_type"] == "DEEPSPEED" and accelerate["use_cpu"] is True
    ds = json.loads((trial_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage and "bf16" not in ds
    result = launch(
        spec,
        on_line=lambda stream, line: None,
        should_stop=lambda: None,
        trial_timeout_s=400,
        hang_timeout_s=300,
        grace_s=5,
    )
    stdout = (trial_dir / "stdout.log").read_text()
    assert result.returncode == 0, result.stderr_tail[-3000:]
    # what really trained, as DeepSpeed's engine reports it
    adam = "DeepSpeedCPUAdam" if offload != "none" else "AdamW"
    assert engine_line(stdout) == (
        f"autotune: engine: deepspeed 0.19.8, ZeRO stage {stage}, optimizer {adam}, offload optimizer="
        f"{offload != 'none'} params={offload == 'optimizer+params'}, backend gloo, world {processes}"
    )
    lines = [json.loads(t) for t in (trial_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]  # rank 0 only, every step
    assert all(m["samples"] == 2 * processes and m["step_time"] > 0 for m in lines)
    assert all(m["memory_kind"] == "host_rss" and m["peak_memory_gib"] > 0.3 for m in lines)
    assert len(re.findall(r"^\{'loss'", stdout, flags=re.M)) == 4


def test_real_cpu_search_pinned_to_zero3_with_optimizer_offload(deepspeed_ops, tmp_path):
    res = run_cli(
        "search",
        "--model",
        "tiny-qwen",
        "--gpus",
        "1",
        "--device",
        "cpu",
        "--runner",
        "trl",
        "--max-prompt-length",
        str(PROMPT),
        "--max-completion-length",
        str(COMPLETION),
        "--set",
        "zero_stage=3",
        "--set",
        "offload=optimizer",
        "--set",
        "num_generations=2",
        "--set",
        "gradient_accumulation_steps=1",
        "--trials",
        "2",
        "--confirm",
        "0",
        "--warmup-steps",
        "1",
        "--measure-steps",
        "2",
        "--name",
        "ds",
        cwd=tmp_path,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    study = tmp_path / "runs" / "ds"
    launched = []
    for f in study.glob("trials/*/outcome.json"):
        outcome = json.loads(f.read_text())
        if outcome.get("launched"):
            launched.append((f.parent, outcome))
    assert len(launched) == 2
    for trial_dir, outcome in launched:
        assert outcome["status"] == "ok" and outcome["throughput"] > 0, outcome
        assert outcome["extra"]["peak_source"] == "trainer" and outcome["peak_memory_gib"] > 0.3
        params = json.loads((trial_dir / "params.json").read_text())
        assert params["zero_stage"] == 3 and params["offload"] == "optimizer"
        assert "ZeRO stage 3, optimizer DeepSpeedCPUAdam, offload optimizer=True" in engine_line(
            (trial_dir / "stdout.log").read_text()
        )
    ds = json.loads((study / "best" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert json.loads((study / "best" / "params.json").read_text())["zero_stage"] == 3
