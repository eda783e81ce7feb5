"""scripts/phase_noise.py reads what a real trainer logged: the sixth lease's TRL trials on an H200
(tests/data/gpu/phase_h200/, the worker's own metrics.jsonl), and gives the figures
docs/gpu-validation.md quotes from them."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "gpu" / "phase_h200"
SCRIPT = ROOT / "scripts" / "phase_noise.py"


def _module():
    spec = importlib.util.spec_from_file_location("phase_noise", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_the_first_call_s_runs_give_the_figures_the_docs_quote():
    text = _module().report(DATA / "call1", skip=2)
    rows = [line for line in text.splitlines() if line.startswith("| gradient_accumulation_steps=")]
    # the two configurations, named by the knobs that differ, four runs each
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| gradient_accumulation_steps=1 per_device_train_batch_size=32", "4"],
        ["| gradient_accumulation_steps=4 per_device_train_batch_size=8", "4"],
    ]
    big, small = ([float(x) for x in row.strip("| ").split(" | ")[2:]] for row in rows)
    # generation is most of the step; 32 x 1 trains in half the time of 8 x 4
    assert big[0] / big[2] > 0.9 and small[0] / small[2] > 0.85
    assert big[1] < 0.6 * small[1]
    # between runs the training phase of 32 x 1 barely moves; the generation phase does
    assert big[4] < big[3] / 4
    assert "Run effects pooled over 8 runs: correlation of generation and training 0.70, " in text
    assert "shared fraction 0.32." in text
    ratio = re.search(r"Generation time, .* / .*: ([0-9.]+)", text)
    assert ratio is not None and float(ratio.group(1)) == 0.944


def test_too_few_repeats_say_so_and_the_command_runs_as_documented(tmp_path):
    text = _module().report(DATA / "call2", skip=2)
    assert "Too few repeated runs to pool the run effects" in text
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(DATA), "--skip", "2"], capture_output=True, text=True, check=True
    )
    assert "Run effects pooled over 11 runs" in done.stdout
    # a folder with no trials is an empty table, not a traceback
    empty = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert empty.returncode == 0 and "Too few repeated runs" in empty.stdout
