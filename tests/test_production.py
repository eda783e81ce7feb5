"""`autotune run STUDY`, for real on CPU: a template trainer whose memory grows with the step runs
under a real RLIMIT_AS cap, dies of a real MemoryError at step 8 of 20 on the exported batch, and
finishes on a smaller batch (the global batch kept) resumed from its own checkpoint-7.

The sizes of tests/data/templates/growing_trainer.py: a step allocates batch x (7 + step) units of
8.65 MiB. Under --memory-limit 1 (GiB): batch 16 dies at step 1 (a trial sees it), batch 8 runs
the 4-6 steps of a trial (104 units at step 6) but dies at step 8 (120 units), batch 4 runs all 20
steps (108 units at step 20). So the search exports batch 8 and only a long run finds out.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

DATA = ROOT / "tests" / "data" / "templates"
TEMPLATE = (
    f"{sys.executable} {DATA / 'growing_trainer.py'} --batch {{batch}} --accum {{accum}} "
    "--max_steps {max_steps} --output_dir {trial_dir}"
)
# three trials: each batch of the space once (16 dies, 8 is fastest, 4 the safer one)
SEARCH = [
    "search", "--model", "tiny-qwen", "--gpus", "1", "--device", "cpu", "--memory-limit", "1",
    "--space", DATA / "growing_space.yaml", "--command", TEMPLATE, "--global-batch", "16",
    "--warmup-steps", "1", "--measure-steps", "2", "--trials", "3", "--confirm", "0", "--name", "grow",
]  # fmt: skip


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One real search of the growing trainer; each test runs on its own copy of the study."""
    runs = tmp_path_factory.mktemp("searched") / "runs"
    res = run_cli(*SEARCH, "--runs-dir", runs, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    best = json.loads((runs / "grow" / "best" / "params.json").read_text())
    assert best["batch"] == 8 and best["accum"] == 2, best  # 16 died in its trial, 8 is fastest
    return runs


@pytest.fixture
def runs(searched, tmp_path):
    copy = tmp_path / "runs"
    shutil.copytree(searched, copy)
    return copy


def attempt(runs: Path, n: int) -> Path:
    return runs / "grow" / "run" / "attempts" / str(n)


def states(folder: Path) -> dict[int, dict]:
    return {
        int(p.name.split("-")[1]): json.loads((p / "state.json").read_text())
        for p in folder.glob("checkpoint-*")
    }


@pytest.mark.slow
def test_oom_at_step_8_resumes_from_checkpoint_7_on_the_smaller_batch(runs):
    res = run_cli("run", "grow", "--runs-dir", runs, "--steps", "20", timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    first, second = attempt(runs, 1), attempt(runs, 2)
    assert "MemoryError" in (first / "stderr.log").read_text()  # the real one, not a printed word
    # every checkpoint of the failed attempt is still there, as it wrote it (batch 8, accum 2)
    saved = states(first)
    assert sorted(saved) == list(range(1, 8)) and all(s["batch"] == 8 for s in saved.values())
    ran = json.loads((second / "ran.json").read_text())
    assert (ran["batch"], ran["accum"], ran["start"]) == (4, 4, 7)  # global batch 16 kept
    assert (second / "resumed_from.txt").read_text().strip() == str((first / "checkpoint-7").resolve())
    assert sorted(states(second)) == list(range(8, 21))
    steps = [json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(8, 21))
    show = run_cli("show", "grow", "--runs-dir", runs)
    line = next(x for x in show.stdout.splitlines() if x.startswith("production run incident 1"))
    assert "oom/host at step 8 of run attempt 1" in line and "MemoryError" in line, line
    assert "batch=4" in line and "accum=4" in line and "checkpoint-7" in line, line
    print(line)
    summary = (runs / "grow" / "best" / "summary.md").read_text()
    assert "failed in a long run (oom/host at step 8, incident 1)" in summary
    assert json.loads((runs / "grow" / "best" / "params.json").read_text())["batch"] != 8
    again = run_cli("run", "grow", "--runs-dir", runs, "--steps", "20")  # nothing left to do
    assert again.returncode == 0 and "finished: checkpoint-20" in again.stdout, again.stdout


@pytest.mark.slow
def test_a_transient_crash_is_restarted_once_on_the_same_configuration(runs, tmp_path):
    env = {"GROWING_CRASH_AT": f"3:{tmp_path / 'crashed'}"}
    res = run_cli("run", "grow", "--runs-dir", runs, "--steps", "10", env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((attempt(runs, 2) / "ran.json").read_text())["batch"] == 8  # the same
    assert json.loads((attempt(runs, 2) / "ran.json").read_text())["start"] == 2
    assert json.loads((attempt(runs, 3) / "ran.json").read_text())["batch"] == 4  # then the OOM
    show = run_cli("show", "grow", "--runs-dir", runs).stdout
    assert "incident 1: crash at step 3" in show and "the same configuration" in show, show


@pytest.mark.slow
def test_a_second_crash_and_spent_restarts_stop_with_each_incident(runs):
    res = run_cli("run", "grow", "--runs-dir", runs, "--steps", "10", env={"GROWING_CRASH_AT": "3"})
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert lines[0] == "stopped (a second crash):" and len(lines) == 3, res.stderr
    assert "incident 1: crash" in lines[1] and "incident 2: crash" in lines[2] and "stopped" in lines[2]
    res = run_cli("run", "grow", "--runs-dir", runs, "--steps", "10", "--max-restarts", "0")
    assert res.returncode == 1
    assert "--max-restarts 0 spent" in res.stderr and "incident 3: oom/host at step 8" in res.stderr


@pytest.mark.slow
def test_sigterm_reaches_the_trainer_which_saves_and_a_rerun_resumes(runs):
    cmd = [sys.executable, "-m", "autotune", "run", "grow", "--runs-dir", str(runs), "--steps", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    metrics = attempt(runs, 1) / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= 2
    ):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    saved = states(attempt(runs, 1))
    assert any(s["why"] == "SIGTERM" for s in saved.values()), saved
    stopped_at = max(saved)
    assert f"autotune run again goes on from checkpoint-{stopped_at}" in err
    # the attempt's own record says it was stopped, not that it crashed
    record = json.loads((attempt(runs, 1) / "outcome.json").read_text())
    assert (record["status"], record["error_line"]) == ("interrupted", "SIGTERM, passed on by autotune run")
    res = run_cli("run", "grow", "--runs-dir", runs, "--steps", "6")
    assert res.returncode == 0, res.stderr
    assert json.loads((attempt(runs, 2) / "ran.json").read_text())["start"] == stopped_at


def test_an_attempt_resumed_from_checkpoint_n_that_died_before_a_step_died_in_step_n_plus_1(tmp_path):
    """A resumed TRL attempt that runs out of memory in its first step writes no metrics line: its
    failed step is the checkpoint's + 1, not 1 (a trial's own count starts again at 0)."""
    from autotune.production.supervisor import failed_step
    from autotune.trial.outcome import Outcome

    died = Outcome(status="oom", oom_kind="host", steps=0)
    assert failed_step(tmp_path, died, resumed_at=2) == 3
    assert failed_step(tmp_path, died) == 1
    (tmp_path / "metrics.jsonl").write_text('{"step": 5}\n{"step": 6}\n')  # global steps, as reported
    assert failed_step(tmp_path, Outcome(status="oom", steps=2), resumed_at=4) == 7
