"""scripts/gpu_microbatch.py, the lease's micro-batch measurement, runs here on the CPU on a tiny
card (a smoke run of the script, not a measurement): each train row times forward + backward of the
global batch as micro-batches, each generate row a real ``generate`` of the asked new tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_microbatch_script_times_train_and_generate_on_a_tiny_card(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_microbatch.py"),
        "--card",
        "tiny-qwen",
        "--prompt",
        "16",
    ]
    cmd += ["--completion", "16", "--global", "4", "--batches", "1,4", "--gen-batches", "2", "--new", "5"]
    subprocess.run([*cmd, "--out", str(tmp_path)], check=True, capture_output=True, timeout=600)
    written = json.loads((tmp_path / "microbatch.json").read_text())
    assert written["meta"]["device"] == "cpu" and written["meta"]["seq"] == 32
    train = [r for r in written["rows"] if r["part"] == "train"]
    assert sorted((r["batch"], r["checkpointing"]) for r in train) == [
        (1, False),
        (1, True),
        (4, False),
        (4, True),
    ]
    assert all(r["sequences"] == 4 and r["per_sequence_s"] > 0 for r in train)
    (gen,) = [r for r in written["rows"] if r["part"] == "generate"]
    assert gen["new_tokens"] == 5 and gen["per_step_s"] > 0
    assert "| 4 | y |" in (tmp_path / "microbatch.md").read_text()
    # every row also went to the live file as it was measured
    live = [json.loads(line) for line in (tmp_path / "microbatch.jsonl").read_text().splitlines()]
    assert live == written["rows"]


def test_the_microbatch_script_refuses_what_it_cannot_measure(tmp_path):
    """A micro-batch over the global batch would time another global batch; a 7B card on a CPU is
    no measurement: one line each, exit 2, nothing written."""
    script = [sys.executable, str(ROOT / "scripts" / "gpu_microbatch.py"), "--out", str(tmp_path / "x")]
    over = subprocess.run(
        [*script, "--card", "tiny-qwen", "--global", "4", "--batches", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert over.returncode == 2 and "over --global 4" in over.stderr
    big = subprocess.run([*script, "--card", "qwen2.5-7b"], capture_output=True, text=True, timeout=300)
    assert big.returncode == 2 and "only a tiny card" in big.stderr
    assert not (tmp_path / "x").exists()
