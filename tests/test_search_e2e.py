"""End to end through the real CLI: real subprocess trials, real SQLite, real exports."""

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_cli

SIM = [
    "search",
    "--model",
    "Qwen2.5-7B-Instruct",
    "--gpus",
    "4",
    "--runner",
    "sim",
    "--gpu-type",
    "A100-80GB",
]


def outcomes(study_dir: Path) -> dict[int, dict]:
    out = {}
    for f in (study_dir / "trials").glob("*/outcome.json"):
        out[int(f.parent.name)] = json.loads(f.read_text())
    return out


# README's sim search (tests/test_readme.py) is this module's plain sim search: it checks the OOMs,
# every trial's files, the SQLite study, show --json and export on the study README's command made


TRAINER = textwrap.dedent('''
    """A small trainer for tests: speed grows with batch size, memory too; big batches OOM."""
    import argparse, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--per_device_train_batch_size", type=int)
    p.add_argument("--num_generations", type=int)
    p.add_argument("--gradient_checkpointing")
    a = p.parse_args()
    print("loading model", flush=True)
    memory = 20 + 7 * a.per_device_train_batch_size * (0.6 if a.gradient_checkpointing == "true" else 1)
    for step in range(1, 12):
        if memory > 79:
            print("Traceback (most recent call last):", file=sys.stderr)
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
                  "total capacity of 79.25 GiB of which 1.20 GiB is free.", file=sys.stderr)
            sys.exit(1)
        step_time = 10.0 / a.per_device_train_batch_size ** 0.5
        time.sleep(0.01)
        print({"loss": 0.1, "step_time": step_time, "memory(GiB)": memory, "epoch": step / 100}, flush=True)
''')


@pytest.mark.slow
def test_command_runner_search(tmp_path):
    (tmp_path / "trainer.py").write_text(TRAINER)
    template = (
        f"{sys.executable} trainer.py --per_device_train_batch_size {{per_device_train_batch_size}} "
        "--num_generations {num_generations} --gradient_checkpointing {gradient_checkpointing}"
    )
    res = run_cli(
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
        "8",
        "--name",
        "cmd",
        "--set",
        "num_generations=4",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    study = tmp_path / "runs" / "cmd"
    got = outcomes(study)
    statuses = {o["status"] for o in got.values()}
    assert "ok" in statuses and "oom" in statuses
    for _n, o in got.items():
        if o["status"] == "oom":
            assert o["oom_kind"] == "cuda" and "CUDA out of memory" in o["error_line"]
    for o in got.values():
        if o["status"] == "ok":
            assert o["peak_memory_gib"] > 20  # read from ms-swift style memory(GiB)
    # only the named parameters are searched: everything else stays at its default
    params = [json.loads(p.read_text()) for p in study.glob("trials/*/params.json")]
    assert {p["zero_stage"] for p in params} == {3} and {p["num_generations"] for p in params} == {4}
    assert len({p["per_device_train_batch_size"] for p in params}) > 1
    cmd = (study / "trials" / "0" / "command.txt").read_text()
    assert "trainer.py --per_device_train_batch_size" in cmd and "AUTOTUNE_METRICS_FILE=" in cmd
    best = json.loads((study / "best" / "params.json").read_text())
    assert 20 + 7 * best["per_device_train_batch_size"] * (0.6 if best["gradient_checkpointing"] else 1) <= 79


def test_repeated_crash_stops_the_search(tmp_path):
    (tmp_path / "broken.py").write_text(
        "import sys\nprint('ModuleNotFoundError: No module named \"flash_attn\"',"
        " file=sys.stderr)\nsys.exit(1)\n"
    )
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "1",
        "--gpu-type",
        "A10G",
        "--command",
        f"{sys.executable} broken.py {{per_device_train_batch_size}}",
        "--trials",
        "10",
        "--name",
        "broken",
        cwd=tmp_path,
    )
    assert res.returncode == 1
    assert "same crash 3 times in a row" in res.stderr and "flash_attn" in res.stderr
    assert len([o for o in outcomes(tmp_path / "runs" / "broken").values() if o["launched"]]) == 3


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path):
    args = [
        sys.executable,
        "-m",
        "autotune",
        *SIM,
        "--trials",
        "8",
        "--name",
        "r",
        "--sim-time-scale",
        "0.005",
    ]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    study = tmp_path / "runs" / "r"
    deadline = time.time() + 120
    victim = None
    while time.time() < deadline:  # wait until a trial is mid-way (has a pid file)
        finished = outcomes(study) if study.exists() else {}
        pids = list(study.glob("trials/*/pid")) if study.exists() else []
        if len([o for o in finished.values() if o["launched"]]) >= 2 and pids:
            victim = pids[0]
            break
        time.sleep(0.05)
    assert victim is not None, proc.stderr.read().decode() if proc.poll() is not None else "no trial started"
    trial_pid = int(victim.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = outcomes(study)
    interrupted = int(victim.parent.name)
    assert interrupted not in before
    res = run_cli("resume", "r", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    after = outcomes(study)
    assert after[interrupted]["status"] == "interrupted"
    for n, o in before.items():  # nothing finished is lost or re-run
        assert after[n] == o
    launched = [o for o in after.values() if o.get("launched")]
    assert len(launched) == 8
    # the interrupted trial's process did not survive, and its configuration was run again
    assert (
        not Path(f"/proc/{trial_pid}").exists()
        or "Z" in Path(f"/proc/{trial_pid}/stat").read_text().split()[2]
    )
    again = json.loads((study / "trials" / str(interrupted) / "params.json").read_text())
    reruns = [
        n
        for n in after
        if n > interrupted
        and (study / "trials" / str(n) / "params.json").exists()
        and json.loads((study / "trials" / str(n) / "params.json").read_text()) == again
    ]
    assert reruns, "the interrupted configuration is measured on resume"


def test_storage_url_is_used_and_remembered(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared' / 'optuna.db'}"
    (tmp_path / "shared").mkdir()
    res = run_cli(
        *SIM,
        "--trials",
        "2",
        "--name",
        "st",
        "--sim-time-scale",
        "0.0005",
        "--confirm",
        "0",
        "--storage",
        url,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "runs" / "st" / "study.db").exists()
    with sqlite3.connect(tmp_path / "shared" / "optuna.db") as db:
        (name,) = db.execute("select study_name from studies").fetchone()
    assert name == "st"
    # resume needs only the name: the URL comes from recipe.yaml
    more = run_cli("resume", "st", "--trials", "3", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    shown = json.loads(run_cli("show", "st", "--json", cwd=tmp_path).stdout)
    assert sum(1 for r in shown if r["launched"]) == 3
    bad = run_cli(*SIM, "--trials", "1", "--name", "st2", "--storage", "nosuchdb://x/y", cwd=tmp_path)
    assert (
        bad.returncode == 2
        and bad.stderr.startswith("error: cannot open storage")
        and "Traceback" not in bad.stderr
    )


def test_time_budget_stops_launching(tmp_path):
    res = run_cli(
        *SIM,
        "--trials",
        "30",
        "--name",
        "tb",
        "--time-budget",
        "3s",
        "--confirm",
        "0",
        "--sim-time-scale",
        "0.002",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "would exceed --time-budget" in res.stdout
    launched = [o for o in outcomes(tmp_path / "runs" / "tb").values() if o.get("launched")]
    assert 1 <= len(launched) < 30
    # the budget is the study's: a resume with no new budget has none of it left
    again = run_cli("resume", "tb", cwd=tmp_path)
    assert again.returncode == 0 and "would exceed --time-budget" in again.stdout
    assert len([o for o in outcomes(tmp_path / "runs" / "tb").values() if o.get("launched")]) == len(launched)


BAD_METRICS_TRAINER = textwrap.dedent('''
    """A trainer whose metrics file holds garbage among good lines: a non-UTF-8 byte, a 400-digit
    number, 1e308 samples and a step time of 1e-300 s."""
    import json, os, sys, time
    out = open(os.environ["AUTOTUNE_METRICS_FILE"], "ab", buffering=0)
    sys.stdout.buffer.write(b"loading \\xff\\xfe model\\n"); sys.stdout.flush()
    for step in range(1, 9):
        time.sleep(0.02)
        out.write(b"\\xff\\xfe not utf-8\\n")
        out.write(('{"step": %d, "step_time": %s}\\n' % (step, "9" * 400)).encode())
        out.write(json.dumps({"step": step, "step_time": 1e-300, "samples": 1e308}).encode() + b"\\n")
        out.write(json.dumps({"step": step, "step_time": 0.5, "samples": 64, "peak_memory_gib": 30.0}).encode() + b"\\n")
''')


def test_garbage_in_the_metrics_file_neither_crashes_nor_wins(tmp_path):
    (tmp_path / "trainer.py").write_text(BAD_METRICS_TRAINER)
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "1",
        "--gpu-type",
        "A10G",
        "--command",
        f"{sys.executable} trainer.py {{per_device_train_batch_size}}",
        "--trials",
        "2",
        "--confirm",
        "0",
        "--name",
        "garbage",
        cwd=tmp_path,
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    got = [o for o in outcomes(tmp_path / "runs" / "garbage").values() if o.get("launched")]
    assert len(got) == 2 and all(o["status"] == "ok" for o in got)
    # 64 completions every 0.5 s is what the trainer really did; nothing else may be believed
    assert all(o["throughput"] == pytest.approx(128.0) and o["peak_memory_gib"] == 30.0 for o in got)
