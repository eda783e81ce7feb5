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
CPU = ROOT / "tests" / "data" / "phase_cpu"
SCRIPT = ROOT / "scripts" / "phase_noise.py"


def _module():
    spec = importlib.util.spec_from_file_location("phase_noise", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _rows(text: str) -> dict[str, list[float]]:
    """The table's rows by configuration: generation, training, step s; between runs, step to step
    and run factor, each for generation, training, step."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| configuration"):
            cells = line.strip("| ").split(" | ")
            rows[cells[0]] = [float(x) for x in cells[3:]]
    return rows


def test_the_first_call_s_runs_give_the_figures_the_docs_quote():
    text = _module().report(DATA / "call1", skip=2)
    rows = _rows(text)
    # the two configurations, named by the knobs that differ, four runs each
    big = rows.pop("gradient_accumulation_steps=1 per_device_train_batch_size=32")
    small = rows.pop("gradient_accumulation_steps=4 per_device_train_batch_size=8")
    assert not rows and "| 4 | 2-4 |" in text and "| 4 | 2-7 |" in text
    # generation is most of the step; 32 x 1 trains in half the time of 8 x 4
    assert big[0] / big[2] > 0.9 and small[0] / small[2] > 0.85
    assert big[1] < 0.6 * small[1]
    # between runs the training phase of 32 x 1 barely moves; the generation phase does
    assert big[4] < big[3] / 4
    # step to step, pooled over each configuration's runs, as docs/gpu-validation.md quotes
    assert (big[3 + 3 + 2], small[3 + 3 + 2]) == (0.088, 0.084)
    # the run factor the steps do not explain: none for 32 x 1, 7% for 8 x 4
    assert (big[3 + 6 + 2], small[3 + 6 + 2]) == (0.0, 0.071)
    assert "Run effects pooled over 8 runs: correlation of generation and training 0.70, " in text
    assert "shared fraction 0.32." in text
    ratio = re.search(r"Generation time, .* / .*: ([0-9.]+)", text)
    assert ratio is not None and float(ratio.group(1)) == 0.944


def test_calls_apart_in_time_are_not_pooled_and_the_command_runs_as_documented(tmp_path):
    text = _module().report(DATA / "call2", skip=2)
    assert "Too few repeated runs to pool the run effects" in text
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(DATA), "--skip", "2"], capture_output=True, text=True, check=True
    )
    # each call's configurations apart (the second call ran a fifth slower), their run effects
    # pooled within a call only: 8 runs of the first, 2 of the second
    assert len(_rows(done.stdout)) == 4 and "| call2: gradient_accumulation_steps=4" in done.stdout
    assert "Run effects pooled over 10 runs" in done.stdout
    assert "Generation time, call1: " in done.stdout and "call1: gradient_accumulation_steps=1" in done.stdout
    # a folder with no trials is an empty table, not a traceback
    empty = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert empty.returncode == 0 and "Too few repeated runs" in empty.stdout


def test_on_cpu_the_training_carries_the_luck_and_the_steps_are_a_fraction_of_it():
    """The thirty-fourth pass's CPU runs (tests/data/phase_cpu/): the figures docs/gpu-validation.md
    sets beside the H200's, the step-to-step noise about 0.6 of the run factor (the lower part of the
    simulator's STEP_RATIO_RANGE)."""
    rows = _rows(_module().report(CPU, skip=2))
    assert sorted(rows) == ["gradient_checkpointing=False", "gradient_checkpointing=True"]
    for row in rows.values():
        between, within, run = row[3:6], row[6:9], row[9:12]
        assert between[1] > 0.2 and between[0] < 0.02  # training moves from run to run, generation not
        assert 0.13 < run[2] < 0.15 and 0.55 < within[2] / run[2] < 0.7
