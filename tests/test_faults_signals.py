"""Issue 22, items 4 and 5: no trial process outlives the controller or its trial.

Real controllers (``python -m autotune search --command``), real trainers that ignore SIGTERM,
real signals sent the way a terminal sends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

STUBBORN = textwrap.dedent("""
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only SIGKILL ends it
    print("loading pid=%d" % os.getpid(), flush=True)
    time.sleep(600)
""")
SEARCH = ("--model", "Qwen2.5-0.5B", "--gpus", "1", "--gpu-type", "A10G", "--confirm", "0")


def controller(tmp_path: Path, script: str, name: str, *extra: str) -> subprocess.Popen:
    (tmp_path / "trainer.py").write_text(script)
    template = f"{sys.executable} {tmp_path / 'trainer.py'} {{per_device_train_batch_size}}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = [sys.executable, "-m", "autotune", "search", *SEARCH, "--command", template, "--name", name]
    return subprocess.Popen(
        [*argv, *extra], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, limit_s: float = 300) -> str:
    """The first line of ``log`` holding ``text``, once the trial printed it (generous: a loaded
    machine takes minutes to import the controller)."""
    deadline = time.monotonic() + limit_s
    while True:
        if log.exists():
            found = [line for line in log.read_text().splitlines() if text in line]
            if found:
                return found[0]
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"{text!r} never appeared in {log}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_ctrl_c_in_quick_succession_leave_no_trial_process(tmp_path: Path) -> None:
    """The second Ctrl-C (0.2 s after the first) used to cut the cleanup short: the trainer that
    ignores SIGTERM never got its SIGKILL and ran on after the controller said "saved"."""
    proc = controller(tmp_path, STUBBORN, "cc", "--trials", "1")
    pid = 0
    try:
        line = wait_for_line(proc, tmp_path / "runs" / "cc" / "trials" / "0" / "stdout.log", "loading pid=")
        pid = int(line.split("pid=")[1])
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 130, err
        assert "the study is saved" in err and "Traceback" not in err, err
        assert not alive(pid), "the trainer that ignores SIGTERM outlived the controller"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_second_ctrl_c_during_the_cleanup_does_not_spare_the_trial(tmp_path: Path) -> None:
    """launch() in the main thread (a confirmation on one slot runs there): the first Ctrl-C
    starts the cleanup (SIGTERM, a grace, SIGKILL); a second one 0.2 s later used to interrupt
    the grace and skip the SIGKILL, leaving a trainer that ignores SIGTERM running."""
    from autotune.trial.launch import LaunchSpec, launch

    (tmp_path / "t.py").write_text(STUBBORN)
    spec = LaunchSpec(argv=[sys.executable, str(tmp_path / "t.py")], trial_dir=tmp_path / "trial", env={})
    pids: list[int] = []
    started = threading.Event()

    def ctrl_c_twice() -> None:
        if started.wait(300):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)

    def on_line(stream: str, text: str) -> None:
        if "pid=" in text and not pids:
            pids.append(int(text.split("pid=")[1]))
            started.set()

    threading.Thread(target=ctrl_c_twice, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(spec, on_line=on_line, should_stop=lambda: None, trial_timeout_s=300, hang_timeout_s=300)
        time.sleep(0.5)  # a second interrupt, if it came after launch returned, lands here
    except KeyboardInterrupt:
        pass
    finally:
        survivor = bool(pids) and alive(pids[0])
        if survivor:
            os.kill(pids[0], signal.SIGKILL)
    assert pids, "the trainer never started"
    assert not survivor, "the trainer that ignores SIGTERM outlived launch()"
