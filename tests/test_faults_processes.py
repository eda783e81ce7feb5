"""Issue 9, processes that outlive a trial or a controller: a setsid'd daemon (fault 3), the vLLM
server sidecar (fault 9), and SIGTERM / SIGHUP to the controller. Real processes, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_cli

from autotune.trial.launch import LaunchSpec, launch
from autotune.trial.processes import TRIAL_ENV, kill_stale

# A trainer whose helper double-forks into a session of its own, ignores SIGTERM and keeps the
# trial's stdout/stderr open: it is in neither the trial's process group nor its process tree.
DAEMON = textwrap.dedent("""
    import os, signal, sys, time
    pid_file, then = sys.argv[1], float(sys.argv[2])
    if os.fork() == 0:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        while True:
            time.sleep(1)
    os.wait()
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    print("step 1", flush=True)
    time.sleep(then)
""")


def gone(pid: int) -> bool:
    """Exited (a zombie that nobody reaps counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(path: Path, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


def sleeper(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, **env},
        start_new_session=True,
    )


@pytest.fixture
def reap():
    """Processes a test started by hand, killed at the end whatever happened."""
    procs: list = []
    yield procs
    for p in procs:
        try:
            if isinstance(p, int):
                os.kill(p, signal.SIGKILL)
            elif p.poll() is None:
                p.kill()
                p.wait()
        except (ProcessLookupError, PermissionError):
            pass


def daemon_spec(tmp_path: Path, then: float) -> tuple[LaunchSpec, Path]:
    trial = tmp_path / "trials" / "0"
    trial.mkdir(parents=True)
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON)
    pid_file = tmp_path / "daemon.pid"
    return LaunchSpec(
        argv=[sys.executable, str(script), str(pid_file), str(then)],
        env={TRIAL_ENV: str(trial)},
        trial_dir=trial,
    ), pid_file


@pytest.mark.parametrize("then, timeout_s", [(0.0, 60.0), (600.0, 1.0)], ids=["exits", "times-out"])
def test_setsid_daemon_is_ended_with_its_trial(tmp_path, reap, then, timeout_s):
    """Fault 3: the daemon held the pipes (each trial ran on past its end) and lived on for good."""
    foreign = sleeper({TRIAL_ENV: str(tmp_path / "trials" / "1")})  # another trial's: not ours
    unmarked = sleeper({})
    reap += [foreign, unmarked]
    spec, pid_file = daemon_spec(tmp_path, then)
    seen: list[str] = []
    try:
        result = launch(
            spec,
            on_line=lambda s, line: seen.append(line),
            should_stop=lambda: None,
            trial_timeout_s=timeout_s,
            hang_timeout_s=60,
            grace_s=1,
        )
    finally:
        if pid_file.exists():
            reap.append(int(pid_file.read_text()))
    daemon = int(pid_file.read_text())
    assert "step 1" in seen
    assert result.stopped == (None if then == 0 else "timeout")
    # not held by the open pipes (they held it 20 s); slack for a loaded machine
    assert result.wall_time_s < timeout_s + 12, result.wall_time_s
    deadline = time.monotonic() + 15
    while not gone(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(daemon), "the setsid'd daemon outlived its trial"
    assert foreign.poll() is None and unmarked.poll() is None  # never touch what is not ours


def test_kill_stale_finds_a_setsid_daemon_after_a_controller_crash(tmp_path, reap):
    """Fault 3 on resume: the dead controller's trial leader is gone; its daemon is in no group of it."""
    spec, pid_file = daemon_spec(tmp_path, 600)
    leader = subprocess.Popen(
        spec.argv,
        env={**os.environ, **spec.env},
        cwd=spec.trial_dir,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
    )
    reap.append(leader)
    daemon = wait_for(pid_file)
    reap.append(daemon)
    foreign = sleeper({TRIAL_ENV: str(tmp_path / "trials" / "1")})
    reap.append(foreign)
    (spec.trial_dir / "pid").write_text(str(leader.pid))
    leader.kill()  # what PDEATHSIG does when the controller is SIGKILLed
    leader.wait()
    assert kill_stale(spec.trial_dir) is True
    assert gone(daemon) and foreign.poll() is None
    assert not (spec.trial_dir / "pid").exists()


# -- fault 9: the vLLM server sidecar --------------------------------------------------------------

FAKE_SERVER = textwrap.dedent("""
    import sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    time.sleep(float(args.get("--delay", 0)))
    if args.get("--fail"):
        print("ValueError: No available memory for the cache blocks", file=sys.stderr)
        sys.exit(1)
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health/" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("127.0.0.1", int(args["--port"])), Health).serve_forever()
""")


@pytest.fixture
def fake_server(tmp_path) -> Path:
    path = tmp_path / "fake_vllm.py"
    path.write_text(FAKE_SERVER)
    return path


@pytest.fixture
def server_runner(recipe_factory, monkeypatch):
    from autotune.candidate.space_file import load_space
    from autotune.hardware import find_gpu_type
    from autotune.models import resolve_model
    from autotune.runners.base import TrialContext
    from autotune.runners.trl import TrlRunner

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    recipe = recipe_factory(
        model="tiny-qwen",
        gpus=2,
        runner="trl",
        device="cuda",
        max_prompt_length=32,
        max_completion_length=16,
        warmup_steps=1,
        measure_steps=2,
        hang_timeout_s=20,
    )
    return TrlRunner(
        TrialContext(
            recipe=recipe,
            space=load_space(),
            model=resolve_model(recipe.model),
            gpu=find_gpu_type(recipe.gpu_type),
        )
    )


SERVER_PARAMS = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    num_generations=2,
    gradient_checkpointing=True,
    use_vllm=True,
    vllm_mode="server",
    vllm_tensor_parallel_size=1,
    zero_stage=0,
    offload="none",
)


def test_each_trial_has_its_own_server_port_and_its_trainer_uses_it(server_runner, tmp_path):
    """Fault 9: every trial's server listened on 8000, where a stale server could answer for it."""
    ports = []
    for n in (0, 1):
        spec = server_runner.prepare(SERVER_PARAMS, tmp_path / "trials" / str(n), n)
        (side,) = spec.sidecars
        port = int(side.argv[side.argv.index("--port") + 1])
        trainer = json.loads((spec.trial_dir / "trial_spec.json").read_text())["grpo_config"]
        assert trainer["vllm_server_port"] == port and side.port == port
        assert side.env[TRIAL_ENV] == str(spec.trial_dir)  # the trial's marker
        ports.append(port)
    assert 8000 not in ports and ports[0] != ports[1]


def fake_sidecar(tmp_path: Path, fake_server: Path, port: int, *args: str) -> LaunchSpec:
    trial = tmp_path / "runs" / "s" / "trials" / "0"
    side = LaunchSpec(
        argv=[sys.executable, str(fake_server), "--port", str(port), *args],
        env={TRIAL_ENV: str(trial)},
        trial_dir=trial / "vllm_server",
    )
    side.port = port  # set, not passed: this file also runs against the code before the field
    return side


def test_a_stale_server_cannot_answer_for_ours(server_runner, tmp_path, fake_server, reap):
    """Fault 9: a server left on the port answered the health check while ours was failing to start."""
    from autotune.runners.base import free_port
    from autotune.runners.trl import start_sidecar, stop_sidecar, wait_health
    from autotune.trial.launch import ServiceFailed

    port = free_port()
    stale = subprocess.Popen([sys.executable, str(fake_server), "--port", str(port)], start_new_session=True)
    reap.append(stale)
    wait_health(f"http://127.0.0.1:{port}/health/", timeout_s=60, interval_s=0.05)
    # ours fails at start-up (a vLLM KV-cache OOM); the stale one answers meanwhile
    side = fake_sidecar(tmp_path, fake_server, port, "--delay", "1", "--fail", "1")
    proc = subprocess.Popen(side.argv, start_new_session=True, stderr=subprocess.DEVNULL)
    reap.append(proc)
    with pytest.raises(RuntimeError, match="exited with status 1"):
        wait_health(f"http://127.0.0.1:{port}/health/", timeout_s=60, proc=proc, interval_s=0.05)
    # and a sidecar is never started on a port someone already holds
    with pytest.raises(RuntimeError, match=f"port {port} .* in use"):
        start_sidecar(side)
    with pytest.raises(ServiceFailed):
        server_runner.start_services(LaunchSpec(argv=[], env={}, trial_dir=tmp_path, sidecars=[side]))
    # our own server on a free port is accepted, and stopped with its pid file gone
    side = fake_sidecar(tmp_path, fake_server, free_port())
    proc = start_sidecar(side)
    reap.append(proc)
    wait_health(f"http://127.0.0.1:{side.port}/health/", timeout_s=60, proc=proc, interval_s=0.05)
    stop_sidecar(proc, grace_s=2, pid_dir=side.trial_dir)
    assert proc.returncode is not None and not (side.trial_dir / "pid").exists()


def test_recovery_finds_the_sidecar_of_a_crashed_controller(tmp_path, fake_server, reap):
    """Fault 9: the server ran in its own session with no pid file, so resume never found it."""
    import optuna

    from autotune.runners.base import free_port
    from autotune.runners.trl import start_sidecar, wait_health
    from autotune.study.paths import StudyPaths
    from autotune.study.recovery import recover_interrupted

    paths = StudyPaths(tmp_path / "runs", "s")
    paths.root.mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{paths.root / 'study.db'}", study_name="s")
    study.ask()  # trial 0 is RUNNING when the controller dies
    side = fake_sidecar(tmp_path, fake_server, free_port())
    assert side.trial_dir.parent == paths.trial_dir(0)
    proc = start_sidecar(side)
    reap.append(proc)
    wait_health(f"http://127.0.0.1:{side.port}/health/", timeout_s=60, proc=proc, interval_s=0.05)
    assert int((side.trial_dir / "pid").read_text()) == proc.pid
    # the controller is gone: only what is on disk and in the processes' environment is left
    assert recover_interrupted(study, paths) == [0]
    assert proc.wait(timeout=60) is not None
    assert not (side.trial_dir / "pid").exists()


# -- SIGTERM / SIGHUP to the controller ------------------------------------------------------------

SLOW_TRAINER = textwrap.dedent("""
    import os, signal, sys, time
    if os.path.exists(sys.argv[1]):     # the flag: run properly (on resume)
        for step in range(1, 8):
            print({"loss": 0.1, "step_time": 0.05, "memory(GiB)": 20.0}, flush=True)
            time.sleep(0.01)
        sys.exit(0)
    if os.fork() == 0:                  # a daemon in a session of its own that ignores SIGTERM
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    print("loading model", flush=True)
    time.sleep(600)
""")


def marked_under(root: Path) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            owner = proc.environ().get(TRIAL_ENV)
            if owner and Path(owner).is_relative_to(root) and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_to_the_controller_act_like_ctrl_c(tmp_path, sig):
    """A scheduler's SIGTERM (or a closed terminal's SIGHUP) skipped all cleanup."""
    trainer, flag = tmp_path / "trainer.py", tmp_path / "run-properly"
    trainer.write_text(SLOW_TRAINER)
    template = f"{sys.executable} {trainer} {flag} {{per_device_train_batch_size}}"
    args = [
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "1",
        "--gpu-type",
        "A10G",
        "--command",
        template,
        "--trials",
        "1",
        "--confirm",
        "0",
        "--name",
        "t",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    study = tmp_path / "runs" / "t"
    try:
        deadline = time.monotonic() + 300  # a loaded machine imports the controller slowly
        while not (
            (study / "trials" / "0" / "stdout.log").exists()
            and "loading" in (study / "trials" / "0" / "stdout.log").read_text()
        ):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the trial never started"
            time.sleep(0.05)
        # the trainer and its daemon: the trainer prints its line right after its first fork, and the
        # daemon is forked by that child after its setsid, so on a loaded machine it can come later
        # (seen once in CI: 1 process when the line was read)
        while len(marked_under(study)) < 2:
            assert time.monotonic() < deadline, f"the daemon never started: {marked_under(study)}"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for left in marked_under(study):
            left.kill()
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err and "autotune resume" in err and "Traceback" not in err
    assert not marked_under(study), "a trial process outlived the controller"
    flag.write_text("")
    res = run_cli("resume", "t", cwd=tmp_path, env={"PYTHONPATH": env["PYTHONPATH"]}, timeout=300)
    assert res.returncode == 0, res.stderr
    first = json.loads((study / "trials" / "0" / "outcome.json").read_text())
    assert first["status"] == "interrupted"
    statuses = [json.loads(p.read_text())["status"] for p in study.glob("trials/*/outcome.json")]
    assert "ok" in statuses, statuses
    assert not marked_under(study)
