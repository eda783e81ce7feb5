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


# --- item 5: a daemon that clears its environment ------------------------------------------

DAEMON_TRAINER = textwrap.dedent("""
    import os, subprocess, sys
    # a daemon with no environment at all (no AUTOTUNE_TRIAL_DIR marker), in a group or session of its own
    daemon = subprocess.Popen(
        ["env", "-i", sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
        start_new_session=sys.argv[1] == "setsid",
        process_group=0 if sys.argv[1] == "own-group" else None,  # out of the trial's group, in its session
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    open("daemon.pid", "w").write(str(daemon.pid))
    print("step 1", flush=True)
""")


def cgroups_here() -> bool:
    from autotune.trial.cgroup import TrialCgroup

    probe = Path(f"/tmp/autotune-cgroup-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    group = TrialCgroup.create(probe)
    if group is not None:
        group.close(probe)
    probe.rmdir()
    return group is not None


def launch_daemon_trainer(tmp_path: Path, how: str, env: dict[str, str]) -> int:
    from autotune.trial.launch import LaunchSpec, launch

    (tmp_path / "t.py").write_text(DAEMON_TRAINER)
    spec = LaunchSpec(
        argv=[sys.executable, str(tmp_path / "t.py"), how], trial_dir=tmp_path / "trial", env=env
    )
    launch(spec, on_line=lambda s, t: None, should_stop=lambda: None, trial_timeout_s=300, hang_timeout_s=300)
    return int((tmp_path / "trial" / "daemon.pid").read_text())


def ended(pid: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(pid)
    if survived:
        os.kill(pid, signal.SIGKILL)
    return not survived


@pytest.mark.skipif(not cgroups_here(), reason="no writable cgroup v2 here (not root, or no cgroup2 mount)")
def test_an_env_i_setsid_daemon_ends_with_its_trial_through_the_cgroup(tmp_path: Path) -> None:
    """It carries no marker and left the session: only the cgroup still knows it is the trial's."""
    daemon = launch_daemon_trainer(tmp_path, "setsid", {})
    assert ended(daemon), "the env -i daemon outlived its trial"
    assert not (tmp_path / "trial" / "cgroup").exists(), "the trial's cgroup was not removed"


def test_without_cgroups_an_env_i_daemon_in_the_trial_session_still_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback: the session recorded at launch (the leader's pid) finds a daemon that left the
    trial's process group (and its marker) but stayed in its session."""
    monkeypatch.setenv("AUTOTUNE_NO_CGROUP", "1")
    daemon = launch_daemon_trainer(tmp_path, "own-group", {})
    assert not (tmp_path / "trial" / "cgroup").exists()
    assert ended(daemon), "the env -i daemon outlived its trial"
