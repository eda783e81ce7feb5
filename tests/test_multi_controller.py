"""Two controllers on one SQLite study, on one machine: they cooperate, and never duplicate work.

Before, two `autotune search` commands on one study ran 15 trials of 10, measured configurations
twice, confirmed into one folder twice and the first died with UpdateFinishedTrialError.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

SIM = ["--model", "Qwen2.5-7B-Instruct", "--gpus", "4", "--gpu-type", "A100-80GB", "--runner", "sim"]


def _start(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_second_search_and_a_resume_share_the_study(tmp_path):
    """A search, a second search with the same flags and a resume, all on one live study."""
    args = ["--trials", "10", "--sim-time-scale", "0.004", "--name", "s"]
    first = _start("search", *SIM, *args, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("runs/s/trials/*/stdout.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    second = _start("search", *SIM, *args, cwd=tmp_path)
    time.sleep(1)
    third = _start("resume", "s", cwd=tmp_path)
    outs = [p.communicate(timeout=600)[0] for p in (first, second, third)]
    for proc, out in zip((first, second, third), outs):
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out and "UpdateFinishedTrialError" not in out, out[-3000:]

    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'runs/s/study.db'}")
    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    launched = [t for t in trials if t.user_attrs.get("launched")]
    assert len(launched) == 10, f"{len(launched)} launched for --trials 10"
    keys = [t.user_attrs["key"] for t in launched]
    assert len(keys) == len(set(keys)), "a configuration was measured twice"
    folders = list(tmp_path.glob("runs/s/trials/*/command.txt"))
    assert len(folders) == 10
    confirmed = [int(n) for out in outs for n in re.findall(r"confirming trial (\d+)", out)]
    assert confirmed and len(confirmed) == len(set(confirmed)), f"a trial was confirmed twice: {confirmed}"
    assert (tmp_path / "runs/s/best/params.json").exists()


@pytest.mark.slow
def test_a_killed_controller_is_taken_over_by_the_live_one(tmp_path):
    """Two controllers; one is SIGKILLed mid-trial. The live one sees the dead one's trial (same
    machine: its process is gone), kills its leftover process and runs it again."""
    args = ["--trials", "6", "--sim-time-scale", "0.01", "--name", "k", "--confirm", "0"]
    doomed = _start("search", *SIM, *args, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("runs/k/trials/*/stdout.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    live = _start("search", *SIM, *args, cwd=tmp_path)
    time.sleep(2)
    storage = f"sqlite:///{tmp_path / 'runs/k/study.db'}"
    running = None
    while running is None and time.monotonic() < deadline:   # one of the doomed controller's, just launched
        for t in optuna.load_study(study_name="k", storage=storage).get_trials(states=(TrialState.RUNNING,)):
            log = tmp_path / "runs/k/trials" / str(t.number) / "stdout.log"
            if (t.system_attrs.get("autotune:owner", "").endswith(f":{doomed.pid}") and log.exists()
                    and "step" not in log.read_text()):        # starting up: far from its result
                running = log.parent
        if running is None:
            time.sleep(0.1)
    assert running is not None
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=30)
    out = live.communicate(timeout=600)[0]
    assert live.returncode == 0, out[-3000:]
    study = optuna.load_study(study_name="k", storage=f"sqlite:///{tmp_path / 'runs/k/study.db'}")
    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    killed = study.trials[int(running.name)]
    assert killed.state == TrialState.FAIL
    rerun = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
    assert len(rerun) == 1 and rerun[0].user_attrs.get("launched")
    launched = [t for t in trials if t.user_attrs.get("launched")]
    assert len(launched) == 6
    keys = [t.user_attrs["key"] for t in launched]
    assert len(keys) == len(set(keys))
    assert not (running / "pid").exists()          # its orphaned trial process was killed and cleaned up
