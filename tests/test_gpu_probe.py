"""scripts/gpu_probe/sitecustomize.py, the tensor probe for the GPU question of docs/gpu-validation.md
(row Z: which buffer holds a ZeRO-3 trial's second copy of the model), checked on CPU.

A real tiny-qwen TRL trial runs with the probe on PYTHONPATH, as ``PARTS=zero3probe
scripts/gpu_checks.sh`` runs it on a GPU: plain torch and DeepSpeed ZeRO-3 (no offload, so no
cpu_adam to compile; DeepSpeed's shm_comm op is built first, once per machine, as
tests/test_deepspeed_cpu.py does). Its one GPU run has to answer the question, so the snapshot points and the
tensor groups are checked here, where a broken probe costs nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, params, run_trial

pytestmark = pytest.mark.slow  # real TRL imports and trials: half a minute or more each

PROBE = ROOT / "scripts" / "gpu_probe"
# step N generates its batch (entry, inside TRL's gather, exit), then trains and ends
POINTS = [("train_begin", 0)] + [
    (point, n) for n in (1, 2, 3) for point in ("generate_enter", "gathered", "generate_exit", "step_end")
]


def probe_env(out: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")])}
    env.pop("AUTOTUNE_TENSOR_PROBE", None)
    if out is not None:
        env["AUTOTUNE_TENSOR_PROBE"] = str(out)
    return env


def probe_lines(out: Path) -> list[dict]:
    files = sorted(out.glob("probe-*.jsonl"))
    assert len(files) == 1, files  # the worker only: neither the launcher nor accelerate import TRL's trainer
    return [json.loads(line) for line in files[0].read_text().splitlines()]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_probe_snapshots_a_real_trial(recipe_factory, tmp_path, monkeypatch, zero_stage):
    if zero_stage == 3:  # minutes when not cached yet: not inside the trial's hang timeout
        build = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
        done = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "probe"
    for key, value in probe_env(out).items():
        monkeypatch.setenv(key, value)
    trial = {**params(2, 1, 2), "zero_stage": zero_stage}
    result, trial_dir, metrics = run_trial(recipe_factory, tmp_path, trial, measure_steps=2)
    assert result.returncode == 0, result.stderr_tail[-3000:]
    # no controller here to stop it once measured: the runner's two extra steps run too (and
    # generate), which the probe leaves alone
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]

    lines = probe_lines(out)
    assert [line for line in lines if "probe_error" in line] == []
    assert [(line["point"], line["call"]) for line in lines] == POINTS
    for line in lines:
        tensors = line["tensors"]
        assert line["memory"]["device"] == "cpu" and "allocator" not in line  # CUDA only
        assert tensors["total_gib"] > 0 and all(n > 0 and gib > 0 for n, gib in tensors["groups"].values())
        assert tensors["largest"] and all(row["gib"] > 0 and row["views"] >= 1 for row in tensors["largest"])
    assert [line["step"] for line in lines if line["point"] == "step_end"] == [1, 2, 3]

    def rows(point: str) -> list[list[dict]]:
        return [line["tensors"]["largest"] for line in lines if line["point"] == point]

    def owners(point: str) -> list[set[str]]:
        return [{o for row in largest for o in row.get("owners", [])} for largest in rows(point)]

    # tiny-qwen's one parameter over 1 MiB is its embedding (tied to the head): 151,936 x 64 floats
    embedding = "model.embed_tokens.weight"
    if zero_stage == 3:
        # ZeRO-3 (one process): gc sees the flat fp32 partition that the parameters' ds_tensor
        # views share, the embedding gathered into it (DeepSpeed status AVAILABLE) only inside
        # TRL's gather, and DeepSpeed's gradient buffer by the attribute that holds it
        for largest in rows("gathered"):
            (row,) = [row for row in largest if embedding in row.get("names", [])]
            assert "parameter" in row["kinds"] and row["ds"][1] == "AVAILABLE" and row["views"] > 1
        for largest in rows("generate_exit"):
            names = [name for row in largest for name in row.get("names", [])]
            assert embedding not in names and f"{embedding}.ds_tensor" in names
        assert all("dict['grad_partitions_flat_buffer']" in found for found in owners("step_end"))
        assert all(key.endswith(" ds") for key in lines[-1]["tensors"]["groups"] if "parameter" in key)
    else:
        # plain torch: the parameter, and from step 1 on AdamW's two moments by their state keys
        for line in lines:
            assert line["tensors"]["groups"]["parameter float32 plain"] == [1, 0.0362]
            assert line["tensors"]["largest"][0]["names"] == [embedding]
        assert all({"dict['exp_avg']", "dict['exp_avg_sq']"} <= found for found in owners("step_end"))
        assert [line["tensors"]["groups"].get("other float32 plain") for line in lines[:4]] == [None] * 4


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


CHECK = (
    "import sys, sitecustomize, trl.trainer.grpo_trainer as g\n"
    "print(sitecustomize.__file__)\n"
    "print('patched' if hasattr(g.GRPOTrainer._generate, '__wrapped__') else 'untouched')\n"
    "sitecustomize._guarded('boom', lambda: 1 / 0)\n"
)


def test_probe_is_inert_without_its_variable_and_chains_another_sitecustomize(tmp_path):
    # a sitecustomize further down the path (a distribution's, say) still runs under the probe's
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the other sitecustomize ran')\n")
    env = probe_env(None)
    env["PYTHONPATH"] += os.pathsep + str(other)
    done = run_python(CHECK, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "the other sitecustomize ran",
        str(PROBE / "sitecustomize.py"),
        "untouched",
    ]
    assert not list(tmp_path.rglob("probe-*.jsonl")) and not list(ROOT.glob("probe-*.jsonl"))

    # with it: TRL's trainer is patched when imported, and the probe's own errors become lines
    out = tmp_path / "probe"
    done = run_python(CHECK, probe_env(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "patched"
    (line,) = probe_lines(out)
    assert line["point"] == "boom" and line["probe_error"].startswith("ZeroDivisionError")


def test_the_allocator_view_splits_segments_by_stream(monkeypatch):
    """No GPU here, so torch's snapshot is stood in for by one in its format (segments with their
    stream and blocks, a device trace of segment events): each stream's reserved and in-use GiB, and
    which code grew the segments on which stream."""
    import importlib.util

    import torch

    monkeypatch.delenv("AUTOTUNE_TENSOR_PROBE", raising=False)
    spec = importlib.util.spec_from_file_location("probe_under_test", PROBE / "sitecustomize.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    gib = 2**30
    frame = {"filename": "/x/deepspeed/runtime/zero/partition_parameters.py", "line": 74, "name": "__init__"}
    snapshot = {
        "segments": [
            {
                "stream": 0,
                "total_size": 2 * gib,
                "active_size": gib // 2,
                "blocks": [
                    {"state": "active_allocated", "size": gib // 2, "frames": []},
                    {"state": "inactive", "size": 3 * gib // 2, "frames": []},
                ],
            },
            {
                "stream": 7,
                "total_size": 3 * gib,
                "active_size": 0,
                "blocks": [
                    {"state": "inactive", "size": 3 * gib, "frames": [frame]},
                ],
            },
        ],
        "device_traces": [[{"action": "segment_alloc", "size": 3 * gib, "stream": 7, "frames": [frame]}]],
    }
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot)
    view = probe._allocator()
    assert view["segments_by_stream_gib"] == {"0": [2.0, 0.5], "7": [3.0, 0.0]}
    assert view["segments_gib"] == 5.0 and view["inactive_gib"] == 4.5
    (grown, size), *_ = view["segments_grown_by"]
    assert grown.startswith("stream 7: deepspeed/runtime/zero/partition_parameters.py:74") and size == 3.0
