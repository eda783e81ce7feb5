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

pytestmark = pytest.mark.filterwarnings(
    "ignore:Heartbeat of storage is supposed"
)  # ask/tell use heartbeats too

SIM = ["--model", "Qwen2.5-7B-Instruct", "--gpus", "4", "--gpu-type", "A100-80GB", "--runner", "sim"]


def _start(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


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
    while running is None and time.monotonic() < deadline:  # one of the doomed controller's, just launched
        for t in optuna.load_study(study_name="k", storage=storage).get_trials(states=(TrialState.RUNNING,)):
            log = tmp_path / "runs/k/trials" / str(t.number) / "stdout.log"
            if (
                t.system_attrs.get("autotune:owner", "").endswith(f":{doomed.pid}")
                and log.exists()
                and "step" not in log.read_text()
            ):  # starting up: far from its result
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
    assert not (running / "pid").exists()  # its orphaned trial process was killed and cleaned up


# -- unit checks of the pieces above: claims, heartbeats, recovery, the scheduler's exits ---------------
def _heartbeat_study(tmp_path, grace: int = 1):
    """A SQLite study with Optuna heartbeats every second (grace ``grace`` s), as open_study makes."""
    import warnings

    from autotune.study.paths import StudyPaths
    from autotune.study.recovery import RetryInterrupted

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    paths = StudyPaths(tmp_path / "runs", "s")
    paths.root.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(
            f"sqlite:///{paths.db}",
            heartbeat_interval=1,
            grace_period=grace,
            heartbeat_stale_trial_callback=RetryInterrupted(paths),
        )
    return optuna.create_study(study_name="s", storage=storage, direction="maximize"), paths


def test_a_claim_is_refused_for_a_configuration_told_meanwhile(tmp_path):
    """Controller A tells configuration K between B's look at the study and B's claim: B's claim
    says it is measured (B answers it from the study) instead of launching it again."""
    from autotune.study.claims import claim

    study, _ = _heartbeat_study(tmp_path)
    for key, status in (("K", "ok"), ("S", "skipped")):
        told = study.ask()
        told.set_user_attr("key", key)
        told.set_user_attr("status", status)
        study.tell(told, 1.0 if status == "ok" else None, state=None if status == "ok" else TrialState.FAIL)
    mine = study.ask()
    refused = claim(study, mine, {"a": 1}, "K", limit=10)
    assert not refused.granted and refused.why == "measured" and refused.other == 0
    assert claim(study, mine, {"a": 2}, "S", limit=10).granted  # a memory-model skip is asked again


class _Stop:
    def __init__(self, reason):
        self.value = reason

    def reason(self):
        return self.value


class _FakeSearch:
    """What the Scheduler uses of a Search (its steps, and a state with a stop reason), with a
    measure that records calls."""

    def __init__(self, paths, study, *, stop=None, measure_error=None):
        from types import SimpleNamespace

        from autotune.search.state import SearchState

        self.state = SearchState(
            recipe=SimpleNamespace(trials=5),
            paths=paths,
            space=None,
            fixed={},
            reporter=SimpleNamespace(message=lambda *a: None),
            planner=None,
            study=study,
            stopping=_Stop(stop),
        )
        self.measured: list[int] = []
        self.measure_error = measure_error

    def gate(self, number, params, previous):
        return None, None

    def measure(self, trial, params, number, predicted_gib):
        from autotune.trial.outcome import Outcome

        self.measured.append(trial.number)
        if self.measure_error is not None:
            raise self.measure_error
        return Outcome(status="ok", throughput=1.0, launched=True)

    def tell(self, trial, params, key, outcome):
        self.state.study.tell(trial, 1.0)

    def converged(self, launched):
        return None


def _thread(heartbeat):
    return getattr(heartbeat, "_thread", None)


def test_a_failed_trial_thread_stops_its_heartbeat(tmp_path):
    """The trial thread raised: the error goes on, and the trial's heartbeat thread is stopped (it is
    not a daemon: alive, the process would never exit after the one-line error)."""
    from concurrent.futures import Future

    from optuna.storages._heartbeat import get_heartbeat_thread

    from autotune.search.parallel import Asked, Scheduler

    study, paths = _heartbeat_study(tmp_path)
    trial = study.ask()
    heartbeat = get_heartbeat_thread(trial._trial_id, study._storage)
    heartbeat.start()
    search = _FakeSearch(paths, study)
    scheduler = Scheduler(search.state, search, [None])
    scheduler.free = []
    future: Future = Future()
    future.set_exception(RuntimeError("the trial thread failed"))
    try:
        with pytest.raises(RuntimeError):
            scheduler.finish(Asked(trial, {}, "k", heartbeat, slot=0), future)
        assert not _thread(heartbeat).is_alive(), "the heartbeat of the failed trial still runs"
    finally:
        heartbeat.join()


def test_held_candidates_are_dropped_once_the_search_stopped(tmp_path):
    """A candidate held while its twin ran elsewhere is not launched after a stop (time budget): it
    is closed (FAIL, not launched) and its heartbeat stopped, so nothing is left RUNNING."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    from autotune.search.parallel import Asked, Scheduler

    study, paths = _heartbeat_study(tmp_path)
    search = _FakeSearch(paths, study, stop=("time budget", "the time budget is spent"))
    trial = study.ask()
    heartbeat = get_heartbeat_thread(trial._trial_id, study._storage)
    heartbeat.start()
    scheduler = Scheduler(search.state, search, [None])
    scheduler.waiting.append(Asked(trial, {"a": 1}, "k", heartbeat))  # its twin is no longer running
    try:
        stopped = scheduler.run()
    finally:
        heartbeat.join()
    assert stopped and "time budget" in stopped
    assert search.measured == [], "a held candidate was launched after the search stopped"
    left = study.trials[trial.number]
    assert left.state == TrialState.FAIL and left.user_attrs["reason"].startswith("not launched")


def test_a_trial_is_seen_from_another_machine_from_the_moment_it_is_owned(tmp_path):
    """claim_owner records the first heartbeat, so a controller killed inside ask (before its
    heartbeat thread started) leaves a trial that goes stale: another machine fails and re-queues it."""
    from autotune.study.recovery import OWNER_ATTR, claim_owner, recover_interrupted

    study, paths = _heartbeat_study(tmp_path)
    trial = study.ask({"a": optuna.distributions.IntDistribution(0, 9)})
    claim_owner(study, trial)
    study._storage.set_trial_system_attr(
        trial._trial_id, OWNER_ATTR, "elsewhere:1"
    )  # as seen from another node
    time.sleep(2.5)
    recover_interrupted(study, paths)
    after = study.get_trials(deepcopy=False)
    assert after[trial.number].state == TrialState.FAIL
    assert [t.user_attrs.get("retry_of") for t in after if t.state == TrialState.WAITING] == [trial.number]


def test_another_machines_trial_without_any_heartbeat_is_taken_over_after_the_grace(tmp_path):
    """A trial of an older controller killed inside ask: another host's, no heartbeat row at all.
    Left alone within the grace period, failed and queued again after it."""
    from autotune.study.recovery import OWNER_ATTR, recover_interrupted

    study, paths = _heartbeat_study(tmp_path, grace=2)
    trial = study.ask({"a": optuna.distributions.IntDistribution(0, 9)})
    study._storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, "elsewhere:1")
    recover_interrupted(study, paths)
    assert study.trials[trial.number].state == TrialState.RUNNING, "taken over within the grace period"
    time.sleep(2.5)
    recover_interrupted(study, paths)
    after = study.get_trials(deepcopy=False)
    assert after[trial.number].state == TrialState.FAIL
    assert [t.user_attrs.get("retry_of") for t in after if t.state == TrialState.WAITING] == [trial.number]


def test_a_late_heartbeat_of_a_live_controller_here_kills_nothing(tmp_path):
    """This controller's heartbeat thread died (a storage blip) while its trial runs: recovery neither
    fails the trial nor kills its processes nor writes its outcome; nor does the stale callback."""
    from autotune.study.recovery import RetryInterrupted, claim_owner, recover_interrupted
    from autotune.trial.processes import PID_FILE, TRIAL_ENV

    study, paths = _heartbeat_study(tmp_path)
    trial = study.ask()
    claim_owner(study, trial)  # this process: alive, on this machine
    study._storage.record_heartbeat(trial._trial_id)  # its last beat before the thread died
    trial_dir = paths.trial_dir(trial.number)
    trial_dir.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        start_new_session=True,
        env={**os.environ, TRIAL_ENV: str(trial_dir)},
    )
    try:
        (trial_dir / PID_FILE).write_text(str(proc.pid))
        time.sleep(2.5)
        recover_interrupted(study, paths)
        assert study.trials[trial.number].state == TrialState.RUNNING
        RetryInterrupted(paths)(study, study.trials[trial.number])
        assert proc.poll() is None, "the live trial's process was killed"
        assert not (trial_dir / "outcome.json").exists()
        assert not study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    finally:
        proc.kill()
        proc.wait()


def test_the_heartbeat_outlives_a_failed_write():
    """Optuna's heartbeat thread ends at its first error; ours logs it and beats again."""
    from optuna.storages._heartbeat import BaseHeartbeat

    from autotune.study.recovery import Heartbeat

    class Flaky(BaseHeartbeat):
        beats = 0

        def record_heartbeat(self, trial_id):
            self.beats += 1
            if self.beats == 1:
                raise optuna.exceptions.StorageInternalError("database is locked")

        def _get_stale_trial_ids(self, study_id):
            return []

        def get_heartbeat_interval(self):
            return 1

        def get_heartbeat_stale_trial_callback(self):
            return None

    storage = Flaky()
    heartbeat = Heartbeat(0, storage)
    heartbeat.start()
    time.sleep(1.5)
    try:
        assert heartbeat.alive() and storage.beats >= 2
    finally:
        heartbeat.join()
    assert not heartbeat.alive()


def test_the_scheduler_answers_a_claim_refused_as_measured(tmp_path):
    """The gate looked before another controller told K (simulated: the first look misses it); the
    claim refuses K as measured and the scheduler answers it from the study, launching nothing."""
    from concurrent.futures import ThreadPoolExecutor

    from optuna.storages._heartbeat import get_heartbeat_thread

    from autotune.search.parallel import Asked, Scheduler
    from autotune.trial.outcome import Outcome

    study, paths = _heartbeat_study(tmp_path)
    told = study.ask()
    told.set_user_attr("key", "K")
    told.set_user_attr("status", "ok")
    study.tell(told, 1.0)
    looks: list[object] = []

    class Racing(_FakeSearch):
        def gate(self, number, params, previous):
            looks.append(previous)
            if len(looks) == 1 or previous is None:  # the look from before K was told
                return None, None
            return Outcome(status="ok", throughput=1.0, detail="same configuration"), None

    search = Racing(paths, study)
    trial = study.ask()
    heartbeat = get_heartbeat_thread(trial._trial_id, study._storage)
    heartbeat.start()
    scheduler = Scheduler(search.state, search, [None])
    with ThreadPoolExecutor(1) as pool:
        try:
            scheduler.gate_and_launch(Asked(trial, {"a": 1}, "K", heartbeat), pool)
        finally:
            heartbeat.join()
    assert search.measured == [] and not scheduler.running, "a configuration measured meanwhile was launched"
    assert len(looks) == 2 and looks[1] is not None and looks[1][0] == told.number
    assert study.trials[trial.number].state == TrialState.COMPLETE


def test_another_controllers_trials_are_learned_like_our_own(tmp_path):
    """One observe for every path. The scheduler's copy of the planner feedback dropped the leftover
    flag (an OOM beside a predecessor's memory then vetoed the configuration's whole region) and
    never restarted the convergence patience when another controller found a clearly better one."""
    from types import SimpleNamespace

    from autotune.candidate.space_file import load_space
    from autotune.hardware import find_gpu_type
    from autotune.models import resolve_model
    from autotune.recipe import Recipe
    from autotune.search.planner import Planner
    from autotune.search.state import SearchState
    from autotune.study import StudyPaths, candidate_key, record, rows
    from autotune.trial.outcome import Outcome

    gpu = find_gpu_type("A100-80GB")
    recipe = Recipe(model="Qwen2.5-7B-Instruct", gpus=4, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib)
    space = load_space()
    paths = StudyPaths(tmp_path, "s")
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="maximize")
    planner = Planner(resolve_model(recipe.model), recipe, gpu)
    state = SearchState(recipe, paths, space, {}, SimpleNamespace(), planner, study, SimpleNamespace())
    base = space.defaults()
    told = [  # what another controller recorded: an OOM beside leftover memory, then two successes
        (
            {**base, "per_device_train_batch_size": 8},
            Outcome(status="oom", oom_kind="cuda", leftover_gib=9.5),
        ),
        (base, Outcome(status="ok", throughput=2.0, peak_memory_gib=50.0)),
        (
            {**base, "per_device_train_batch_size": 2},
            Outcome(status="ok", throughput=2.5, peak_memory_gib=40.0),
        ),
    ]
    for params, outcome in told:
        trial = study.ask()
        record(
            study,
            trial,
            params,
            outcome,
            launched=True,
            key=candidate_key(params),
            trial_dir=paths.trial_dir(trial.number),
        )
    for row in rows(study):
        state.observe_row(row)
    oom = next(s for s in planner.seen if s.status == "oom")
    assert oom.leftover, "the leftover memory of another controller's OOM was not passed on"
    assert state.best_value == 2.5 and state.improved_at == 3, (state.best_value, state.improved_at)
