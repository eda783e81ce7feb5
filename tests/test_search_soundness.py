"""The search's soundness (issue 8) through real searches: a resume that finds a better
configuration exports it, the time budget holds with confirmations, a model veto is not forever."""

import json
import sys
import textwrap
import time

import optuna
from conftest import run_cli

from autotune.candidate.space_file import load_space
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.progress import Reporter
from autotune.recipe import Recipe
from autotune.runners import TrialContext
from autotune.search.loop import Search, answered
from autotune.study import StudyPaths, candidate_key
from autotune.trial.outcome import Outcome

# A trainer whose speed the test controls from a file: "slow" or "fast" (a printed step time).
TRAINER = textwrap.dedent("""
    import sys, time
    bs = int(sys.argv[1])
    speed = open(sys.argv[2]).read().strip()
    step_time = (20.0 if speed == "slow" else 0.5) / bs ** 0.25
    for step in range(1, 40):
        time.sleep(0.01)
        print({"loss": 0.1, "step_time": step_time, "memory(GiB)": 30 + bs, "epoch": step / 100}, flush=True)
""")


def test_a_resume_that_finds_a_better_configuration_exports_it(tmp_path):
    """Seen: a resume measured 64 completions/s and exported the confirmed 1/s, because confirmation
    stopped once any confirmation existed and the ranking took only confirmed trials."""
    (tmp_path / "trainer.py").write_text(TRAINER)
    speed = tmp_path / "speed.txt"
    speed.write_text("slow")
    template = f"{sys.executable} {tmp_path / 'trainer.py'} {{per_device_train_batch_size}} {speed}"
    first = run_cli(
        "search",
        "--model",
        "Qwen2.5-7B-Instruct",
        "--gpus",
        "1",
        "--gpu-type",
        "A100-80GB",
        "--command",
        template,
        "--trials",
        "2",
        "--confirm",
        "1",
        "--name",
        "r",
        "--warmup-steps",
        "1",
        "--measure-steps",
        "2",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "confirmation of trial" in first.stdout
    speed.write_text("fast")
    again = run_cli("resume", "r", "--trials", "5", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    study = tmp_path / "runs" / "r"
    fast = {}
    for f in study.glob("trials/*/outcome.json"):
        o = json.loads(f.read_text())
        if int(f.parent.name) >= 2 and o.get("launched") and o["status"] == "ok":
            fast[candidate_key(json.loads((f.parent / "params.json").read_text()))] = o["throughput"]
    assert fast, "the resumed search launched no new configuration"
    best = json.loads((study / "best" / "params.json").read_text())
    assert candidate_key(best) in fast, (best, again.stdout)


def test_the_study_clock_counts_confirmations_and_stays_in_budget(tmp_path):
    """Through the real CLI: the time of every trial and confirmation is in the study's saved clock,
    and the clock ends within --time-budget. (Whether a confirmation is admitted by its own length
    is decided in test_a_confirmation_that_would_overrun_the_budget_is_not_started.)"""
    budget = 14.0
    start = time.monotonic()
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-7B-Instruct",
        "--gpus",
        "4",
        "--gpu-type",
        "A100-80GB",
        "--runner",
        "sim",
        "--sim-time-scale",
        "0.012",
        "--trials",
        "2",
        "--confirm",
        "2",
        "--time-budget",
        f"{budget:.0f}s",
        "--name",
        "b",
        cwd=tmp_path,
    )
    wall = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    study = optuna.load_study(study_name="b", storage=f"sqlite:///{tmp_path / 'runs' / 'b' / 'study.db'}")
    elapsed = study.user_attrs["elapsed_s"]
    assert elapsed <= budget + 3.0, (elapsed, res.stdout)  # the controller's own work, on a loaded machine
    confirmed = [k for k in study.user_attrs if k.startswith("confirm:")]
    trials = sum((t.user_attrs.get("wall_time_s") or 0) for t in study.trials)
    confirm_time = sum((study.user_attrs[k].get("wall_time_s") or 0) for k in confirmed)
    assert elapsed >= trials + confirm_time - 0.5, (elapsed, trials, confirm_time)
    assert wall < budget + 180  # a hang guard: imports alone take a minute on a loaded machine


def test_a_memory_model_veto_is_asked_again(tmp_path):
    """A skipped candidate was cached like a measurement and never asked again, although the model
    is re-fitted after every trial."""
    gpu = find_gpu_type("A100-80GB")
    recipe = Recipe(
        model="Qwen2.5-7B-Instruct",
        gpus=4,
        gpu_type=gpu.name,
        gpu_memory_gib=gpu.memory_gib,
        runner="sim",
        name="v",
    )
    context = TrialContext(recipe, load_space(), resolve_model(recipe.model), gpu)
    search = Search(
        recipe, StudyPaths(tmp_path, "v"), context, Reporter(10), storage=optuna.storages.InMemoryStorage()
    )
    study = search.open().study
    params = search.space.normalize(
        {
            **search.space.defaults(),
            "per_device_train_batch_size": 8,
            "zero_stage": 0,
            "gradient_checkpointing": False,
        }
    )
    key = candidate_key(params)
    trial = study.ask()
    search.tell(trial, params, key, Outcome(status="skipped", detail="predicted 120 GiB"))
    assert key not in answered(study)
    # a measured success that needs at least as much memory: the candidate must now be launched
    search.planner.observe(50, {**params, "per_device_train_batch_size": 16}, "ok", None, 70.0, 3.0)
    outcome, _ = search.gate(trial.number + 1, params, answered(study).get(key))
    assert outcome is None


def test_a_confirmation_that_would_overrun_the_budget_is_not_started(tmp_path):
    """Real time, in-process: short trials take 3 s, a confirmation 6.6 s (warm-up 2 + 9 measured
    steps against 2 + 3). The budget ends 5 s after the second trial: a confirmation admitted on
    the short trials' 3 s ran past it. The limit is set as the second trial starts, so the
    controller's own work before it (seconds on a loaded machine) does not count against the 5 s."""
    gpu = find_gpu_type("A100-80GB")
    recipe = Recipe(
        model="Qwen2.5-7B-Instruct",
        gpus=4,
        gpu_type=gpu.name,
        gpu_memory_gib=gpu.memory_gib,
        runner="sim",
        name="t",
        trials=2,
        confirm=1,
        time_budget_s=3600.0,
    )
    context = TrialContext(recipe, load_space(), resolve_model(recipe.model), gpu)
    search: Search

    started: list[int] = []

    def execute(params, trial_dir, number, control):
        budget = search.stopping.budget
        if control.purpose != "confirm":
            started.append(number)
            if len(started) == 2:  # the second trial: the budget ends 5 s after it
                budget.limit_s = budget.elapsed() + 3.0 + 5.0
        start = time.monotonic()
        time.sleep(6.6 if control.purpose == "confirm" else 3.0)
        return Outcome(
            status="ok",
            throughput=1.0 + params["per_device_train_batch_size"] / 100,
            peak_memory_gib=40.0,
            steps=5,
            wall_time_s=time.monotonic() - start,
        )

    search = Search(
        recipe,
        StudyPaths(tmp_path, "t"),
        context,
        Reporter(2),
        execute=execute,
        storage=optuna.storages.InMemoryStorage(),
    )
    result = search.run()
    budget = search.stopping.budget
    assert result.launched == 2, result
    assert budget.elapsed() <= budget.limit_s, (budget.elapsed(), budget.limit_s, result.confirmed)


def test_a_mistyped_command_does_not_claim_the_study_name(tmp_path):
    """The runner's checks ran after recipe.yaml was saved: the corrected command was then refused
    as "already exists with a different recipe"."""
    base = [
        "search",
        "--model",
        "Qwen2.5-7B-Instruct",
        "--gpus",
        "1",
        "--gpu-type",
        "A100-80GB",
        "--name",
        "n",
        "--trials",
        "1",
    ]
    typo = run_cli(*base, "--command", "no-such-trainer {per_device_train_batch_size}", cwd=tmp_path)
    assert typo.returncode == 2 and "no-such-trainer" in typo.stderr
    assert not (tmp_path / "runs" / "n").exists()
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "speed.txt").write_text("fast")
    fixed = run_cli(
        *base,
        "--command",
        f"{sys.executable} trainer.py {{per_device_train_batch_size}} speed.txt",
        cwd=tmp_path,
    )
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    # why it stopped: on the final line and in summary.md
    assert fixed.stdout.strip().splitlines()[-1] == "stopped after 1 trials: the --trials limit"
    assert (
        "- stopped after 1 trials: the --trials limit"
        in (tmp_path / "runs" / "n" / "best" / "summary.md").read_text()
    )


def test_pins_under_which_nothing_can_fit_are_refused_with_the_part_that_does_not(tmp_path):
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-32B",
        "--gpus",
        "1",
        "--gpu-type",
        "A10G",
        "--runner",
        "sim",
        "--set",
        "zero_stage=0",
        "--name",
        "big",
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "nothing can fit with zero_stage=0" in line and "model states alone" in line and "offload" in line
    assert not (tmp_path / "runs" / "big").exists()
