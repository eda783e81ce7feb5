"""The low-utilization diagnosis where people look: the live progress line, the study (real SQLite),
summary.md. The outcome is built as the controller builds it: samples summarised, then folded into
the outcome by trial/execute's ``add_monitor_summary``."""

from __future__ import annotations

import io
from pathlib import Path

import optuna
import pytest
from conftest import SWIFT_004, SWING_CSV

from autotune.export.summary import summary_md
from autotune.progress import Reporter
from autotune.study.record import candidate_key, record, rows
from autotune.trial.execute import add_monitor_summary
from autotune.trial.outcome import Outcome
from autotune.trial.utilization import summarize_file

TRL_OFFLOAD = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "zero_stage": 3,
    "offload": "optimizer+params",
    "use_vllm": True,
    "vllm_gpu_memory_utilization": 0.5,
}


def swing_outcome(tmp_path: Path, status: str = "ok", params: dict | None = None) -> Outcome:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "gpu.csv").write_text(SWING_CSV)
    summary = summarize_file(tmp_path / "gpu.csv", params=params or SWIFT_004, min_util=0.5)
    outcome = (
        Outcome(status="ok", throughput=2.5, peak_memory_gib=41.2, steps=6)
        if status == "ok"
        else Outcome(status="oom", oom_kind="cuda", error_line="torch.OutOfMemoryError: CUDA out of memory.")
    )
    add_monitor_summary(outcome, summary, "cuda")
    return outcome


def test_the_progress_line_carries_the_diagnosis(tmp_path: Path) -> None:
    out = io.StringIO()
    reporter = Reporter(4, stream=out)
    reporter.trial_finished(3, swing_outcome(tmp_path))
    reporter.trial_finished(4, swing_outcome(tmp_path, status="oom"))
    first, second = out.getvalue().splitlines()
    assert (
        "trial 3 ok 2.5 completions/s, peak 41.2 GiB; low GPU use: GPU utilization below 50% for 35% "
        "of the time (mean 53%)" in first
    )
    assert "--offload_model false" in first and first.endswith("best so far: trial 3 2.5/s")
    assert "trial 4 oom/cuda" in second and "GPU utilization" not in second  # a dying run is not advised


def test_the_study_keeps_the_diagnosis_and_the_dashboards_constraint(tmp_path: Path) -> None:
    study = optuna.create_study(
        study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize"
    )
    told = [
        (TRL_OFFLOAD, swing_outcome(tmp_path / "a", params=TRL_OFFLOAD)),
        ({**TRL_OFFLOAD, "per_device_train_batch_size": 8}, Outcome(status="oom", oom_kind="cuda")),
        ({**TRL_OFFLOAD, "offload": "none"}, Outcome(status="ok", throughput=9.0, peak_memory_gib=78.9)),
    ]
    for number, (params, outcome) in enumerate(told):
        trial = study.ask()
        record(
            study,
            trial,
            params,
            outcome,
            launched=True,
            key=candidate_key(params),
            trial_dir=tmp_path / "trials" / str(number),
            memory_limit_gib=75.3,
        )
    reopened = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    got = {r.number: r for r in rows(reopened)}
    assert got[0].diagnosis.startswith("GPU utilization below 50% for 35% of the time")
    assert "offload=optimizer+params moves the weights" in got[0].diagnosis
    assert got[0].mean_gpu_util == pytest.approx(0.5268, abs=1e-3)
    assert got[1].diagnosis is None and got[2].diagnosis is None
    trials = reopened.get_trials()
    # optuna-dashboard 0.21 reads the list; Optuna 5 reads both and agrees
    assert [t.system_attrs["constraints"] for t in trials] == [
        [0.0],
        [1.0],
        [pytest.approx((78.9 - 75.3) / 75.3)],
    ]
    assert [t.system_attrs["constraints:fits"] for t in trials] == [
        0.0,
        1.0,
        pytest.approx((78.9 - 75.3) / 75.3),
    ]
    # the headroom violator has the highest value, yet Optuna's best trial is the feasible one
    assert reopened.best_trial.number == 0


def test_summary_md_says_when_the_exported_trial_idled(tmp_path: Path, recipe_factory) -> None:
    study = optuna.create_study(
        study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize"
    )
    told = [
        (SWIFT_004, swing_outcome(tmp_path)),
        ({**SWIFT_004, "sleep_level": 0}, swing_outcome(tmp_path, params={**SWIFT_004, "sleep_level": 0})),
        ({**SWIFT_004, "offload_model": False}, Outcome(status="ok", throughput=1.0, peak_memory_gib=50.0)),
    ]
    told[1][1].throughput = 2.0
    for params, outcome in told:
        record(study, study.ask(), params, outcome, launched=True, key=candidate_key(params))
    all_rows = rows(study)
    recipe = recipe_factory(min_util=0.5)
    text = summary_md(tmp_path / "best", all_rows[0], recipe, all_rows, [], ["summary.md"])
    section = text.split("## GPU utilization", 1)[1].split("\n## ", 1)[0]
    assert (
        "**The chosen trial 0 left its GPUs idle** (--min-util 50%): GPU utilization below 50% for 35%"
        in section
    )
    assert "--sleep_level 0" in section.splitlines()[2]
    assert "- trial 1 (2 completions/s): GPU utilization below 50%" in section
    assert "trial 2" not in section
    # a busy winner says so, with its mean
    busy = summary_md(tmp_path / "best", all_rows[2], recipe, all_rows[2:], [], ["summary.md"])
    assert "The chosen trial 2 has no GPU utilization samples" in busy
    all_rows[2].mean_gpu_util = 0.93
    busy = summary_md(tmp_path / "best", all_rows[2], recipe, all_rows[2:], [], ["summary.md"])
    assert "The chosen trial 2 kept its GPUs busy: mean 93% over the measured steps (--min-util 50%)." in busy
