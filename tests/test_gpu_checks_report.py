"""scripts/gpu_checks_report.py reads what autotune wrote: a real study (the simulator's trials,
through the real CLI), not a fixture typed to agree with it."""

import importlib.util
import json
from pathlib import Path

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def _report_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_checks_report", ROOT / "scripts" / "gpu_checks_report.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_report_has_a_row_per_trial_with_its_outcome_and_prediction(tmp_path):
    runs = tmp_path / "runs"
    res = run_cli(
        "search", "--model", "Qwen2.5-1.5B", "--gpus", "1", "--gpu-type", "H100-80GB", "--runner", "sim",
        "--trials", "4", "--confirm", "0", "--name", "gc", "--runs-dir", runs,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    text = _report_module().report(runs)
    assert (runs / "report.md").exists() is False  # report() only returns; main() writes
    trials = sorted((runs / "gc" / "trials").glob("*/outcome.json"), key=lambda p: int(p.parent.name))
    assert len(trials) >= 4
    for path in trials:
        outcome = json.loads(path.read_text())
        (line,) = [x for x in text.splitlines() if x.startswith(f"| gc {path.parent.name} |")]
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[2] == outcome["status"]
        if outcome.get("predicted_gib") is not None:
            assert cells[7] == f"{outcome['predicted_gib']:.1f}"
        if outcome.get("peak_memory_gib") is not None:
            assert cells[5] == f"{outcome['peak_memory_gib']:.1f}"
        params = json.loads((path.parent / "params.json").read_text())
        assert f"per_device_train_batch_size={params['per_device_train_batch_size']}" in cells[1]
    assert "run attempt" not in text  # no production run in this study
