"""Issue 9, faults 6, 7 and 10: a damaged study, a full disk, a trial killed mid-suggest.

Every test works on a real study made by a real sim search (SQLite, trial folders, best/), damages
it the way a user's machine would, and runs the real CLI in a subprocess. The promise under test:
one line that names the fix, exit 2, no traceback, and nothing the user has is deleted or changed.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import SIM, one_line_error, run_cli, snapshot


@pytest.fixture(scope="module")
def made_study(tmp_path_factory) -> Path:
    """A finished two-trial sim study with best/ exported, made once; tests copy it."""
    base = tmp_path_factory.mktemp("made")
    res = run_cli(*SIM, "--trials", "2", "--name", "s", cwd=base)
    assert res.returncode == 0, res.stderr
    assert (base / "runs" / "s" / "best" / "params.json").exists(), res.stdout
    return base / "runs"


@pytest.fixture
def study(made_study, tmp_path) -> Path:
    """A private copy of the made study: ``tmp_path/runs/s``."""
    shutil.copytree(made_study, tmp_path / "runs")
    return tmp_path / "runs" / "s"


# -- fault 6: a damaged study ------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_resume_refuses_a_missing_or_empty_study_db(study, tmp_path, damage):
    db = study / "study.db"
    if damage == "missing":
        db.unlink()
    else:
        db.write_bytes(b"")
    before = snapshot(study)
    trials = len([p for p in (study / "trials").iterdir() if p.name.isdigit()])
    word = "missing" if damage == "missing" else "empty"
    for args in (
        ["resume", "s"],
        ["resume", "s", "--trials", "5"],
        ["show", "s"],
        ["show", "s", "--json"],
        ["export", "s"],
        ["verify", "s"],
    ):
        one_line_error(run_cli(*args, cwd=tmp_path), "study.db", word, f"{trials} trials", "--name")
    # the same flags under the same name must not start over on top of the old trials either
    one_line_error(run_cli(*SIM, "--trials", "2", "--name", "s", cwd=tmp_path), "study.db", word, "--name")
    assert snapshot(study) == before, "nothing is created, changed or deleted"
    assert db.exists() == (damage == "empty")


def test_missing_recipe_is_named_not_no_study(study, tmp_path):
    (study / "recipe.yaml").unlink()
    before = snapshot(study)
    for args in (["resume", "s"], ["show", "s"], ["export", "s"], ["verify", "s"]):
        res = run_cli(*args, cwd=tmp_path)
        one_line_error(res, "recipe.yaml", "missing", "autotune search")
        assert "no study" not in res.stderr
    assert snapshot(study) == before


def corrupt_pages(db: Path, seed: int, fraction: float = 0.5) -> None:
    """Overwrite random 4 KiB pages (never page 1, the header) with random bytes, as a bad disk would."""
    rng = random.Random(seed)
    size = db.stat().st_size
    pages = list(range(1, size // 4096))
    with open(db, "r+b") as fh:
        for page in rng.sample(pages, max(1, int(len(pages) * fraction))):
            fh.seek(page * 4096)
            fh.write(rng.randbytes(4096))


@pytest.mark.parametrize("how", ["pages", "header"])
def test_corrupted_study_db_is_called_damaged(study, tmp_path, how):
    db = study / "study.db"
    if how == "pages":
        corrupt_pages(db, seed=9)
    else:
        with open(db, "r+b") as fh:
            fh.write(b"this is not sqlite at all")
    before = snapshot(study)
    for args in (["show", "s"], ["export", "s"], ["resume", "s", "--trials", "4"]):
        res = run_cli(*args, cwd=tmp_path)
        one_line_error(res, str(db), "damaged", "copy it aside")
        assert "StorageInternalError" not in res.stderr
    assert snapshot(study) == before, "the damaged database is never deleted or rewritten"


# -- fault 7: a full disk (a real, small tmpfs) ------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted at tmp_path/disk; skipped where mounting is not allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(disk: Path, leave_pages: int = 0) -> None:
    """Fill ``disk`` with 4 KiB files until ENOSPC, then free ``leave_pages`` of them."""
    filler = disk / "filler"
    filler.mkdir(exist_ok=True)
    made = []
    while True:
        path = filler / uuid.uuid4().hex
        try:
            with open(path, "wb") as fh:
                fh.write(b"\0" * 4096)
        except OSError:
            path.unlink(missing_ok=True)
            break
        made.append(path)
    for path in made[:leave_pages]:
        path.unlink()


def no_space_error(res, *fragments):
    one_line_error(res, "no space left on device", "free space", *fragments)


def test_export_to_a_full_disk_keeps_what_was_there(study, tmp_path, small_disk):
    out = small_disk / "out"
    first = run_cli("export", "s", "--out", out, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (out / "mine.txt").write_text("the user's own file\n")
    before = snapshot(out)
    fill(small_disk)
    no_space_error(run_cli("export", "s", "--out", out, cwd=tmp_path), str(small_disk), "--out")
    assert snapshot(out) == before, "the previous export and the user's file are untouched"
    fresh = small_disk / "fresh"
    no_space_error(run_cli("export", "s", "--out", fresh, cwd=tmp_path), "--out")
    assert not fresh.exists() or not any(fresh.iterdir()), "no half-written export"
    assert not [p.name for p in small_disk.iterdir() if ".tmp-" in p.name], "no temp folder left behind"


def test_resume_on_a_full_disk_says_so(study, tmp_path, small_disk):
    runs = small_disk / "runs"
    # the plots (report.html carries plotly.js, ~5 MB) would not fit on the 2 MiB disk themselves
    shutil.copytree(study.parent, runs, ignore=shutil.ignore_patterns("report.html"))
    trials_before = snapshot(runs / "s" / "trials")
    fill(small_disk, leave_pages=1)  # recipe.yaml can be rewritten; SQLite cannot grow
    res = run_cli("resume", "s", "--trials", "4", "--runs-dir", runs, cwd=tmp_path)
    no_space_error(res, "--runs-dir")
    assert "StorageInternalError" not in res.stderr
    assert snapshot(runs / "s" / "trials") == trials_before
    shutil.rmtree(small_disk / "filler")
    again = run_cli("resume", "s", "--trials", "3", "--runs-dir", runs, cwd=tmp_path)
    assert again.returncode == 0, again.stderr


# -- fault 10: a trial killed mid-suggest -----------------------------------------------------------
KILL_MID_SUGGEST = r"""
import json, sys
from pathlib import Path
import optuna
from autotune.recipe import Recipe
from autotune.candidate.space_file import load_space
from autotune.study.recovery import claim_owner

root, candidate = sys.argv[1], json.loads(sys.argv[2])
recipe = Recipe.load(Path(root) / "recipe.yaml")
space = load_space(recipe.space)
study = optuna.load_study(study_name="s", storage=f"sqlite:///{root}/study.db")
# what PolicySampler.before_trial stores: the whole candidate as the trial's fixed_params
study.enqueue_trial({k: v for k, v in candidate.items() if k in space.params})
trial = study.ask()
claim_owner(study, trial)                      # as the scheduler does right after asking
names = [n for n in space.params if n in candidate]
for name in names[: len(names) // 2]:          # the controller dies half-way through suggesting
    space.params[name].suggest(trial)
print(trial.number)
"""


def test_trial_killed_mid_suggest_reruns_its_whole_configuration(study, tmp_path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{study / 'study.db'}"
    done = optuna.load_study(study_name="s", storage=storage)
    seeds = done.user_attrs["seeds"]
    candidate = seeds[-1]  # a seed the policy would not reach in this resume
    assert candidate not in [t.user_attrs.get("candidate") for t in done.trials]
    res = subprocess.run(
        [sys.executable, "-c", KILL_MID_SUGGEST, str(study), json.dumps(candidate)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    killed = int(res.stdout.strip())
    left = optuna.load_study(study_name="s", storage=storage).trials[killed]
    assert left.state == optuna.trial.TrialState.RUNNING and 0 < len(left.params) < len(candidate)

    out = run_cli("resume", "s", "--trials", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    after = optuna.load_study(study_name="s", storage=storage)
    assert after.trials[killed].state == optuna.trial.TrialState.FAIL
    assert after.trials[killed].user_attrs["candidate"] == candidate, (
        "show lists the whole interrupted config"
    )
    rerun = after.trials[killed + 1]
    ran = rerun.user_attrs["candidate"]
    assert {k: ran[k] for k in candidate} == candidate, "the whole configuration comes back, not half of it"
    on_disk = json.loads((study / "trials" / str(killed + 1) / "params.json").read_text())
    assert {k: on_disk[k] for k in candidate} == candidate
