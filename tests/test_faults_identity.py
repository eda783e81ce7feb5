"""Issue 22: a study's identity, concurrent commands and damaged trial files.

Every test works on a real sim study (SQLite, trial folders, best/) and runs the real CLI in
subprocesses: one line and exit 2 for what cannot be done, nothing the user has is overwritten.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SIM, one_line_error, run_cli, snapshot


@pytest.fixture(scope="module")
def made_study(tmp_path_factory) -> Path:
    """A finished two-trial sim study named ``base`` with best/ exported, made once."""
    base = tmp_path_factory.mktemp("made")
    res = run_cli(*SIM, "--trials", "2", "--name", "base", cwd=base)
    assert res.returncode == 0, res.stderr
    return base / "runs"


@pytest.fixture
def runs(made_study, tmp_path) -> Path:
    shutil.copytree(made_study, tmp_path / "runs")
    return tmp_path / "runs"


def studies_in(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return sorted(r[0] for r in conn.execute("SELECT study_name FROM studies") if ":lock:" not in r[0])
    finally:
        conn.close()


# -- 1: one study, however its folder is spelled, renamed or copied ---------------------------------
def test_a_trailing_slash_resumes_the_same_study(runs):
    res = run_cli("resume", "base/", "--trials", "3", cwd=runs.parent)
    assert res.returncode == 0, res.stderr
    assert studies_in(runs / "base" / "study.db") == ["base"]
    launched = json.loads(run_cli("show", "base/", "--json", cwd=runs.parent).stdout)
    assert sorted(r["number"] for r in launched) == [0, 1, 2]


@pytest.mark.parametrize("how", ["renamed", "copied"])
def test_a_renamed_or_copied_study_folder_is_refused_and_left_as_it_was(runs, how):
    (shutil.move if how == "renamed" else shutil.copytree)(runs / "base", runs / "other")
    before = snapshot(runs / "other")
    for args in (
        ["resume", "other"],
        ["resume", "other", "--trials", "4"],
        ["show", "other"],
        ["export", "other"],
    ):
        res = run_cli(*args, cwd=runs.parent)
        one_line_error(res, "holds study 'base', not 'other'", "renamed or copied", "mv ")
    assert snapshot(runs / "other") == before
    assert studies_in(runs / "other" / "study.db") == ["base"]


@pytest.mark.parametrize(
    "name, fragment",
    [("a" * 300, "at most 100"), ("-x", "not starting with '-'"), ("runs/base", "is a path")],
)
def test_a_study_name_that_is_no_folder_name_is_refused_before_anything_is_written(tmp_path, name, fragment):
    res = run_cli(*SIM, "--trials", "1", "--name", name, cwd=tmp_path)
    one_line_error(res, fragment)
    assert not (tmp_path / "runs").exists()


# -- 15: files follow the umask, as any other new file ---------------------------------------------
@pytest.mark.parametrize("umask", [0o002])
def test_files_a_search_writes_follow_the_umask(tmp_path, umask):
    res = subprocess.run(
        [sys.executable, "-c", f"import os, sys; os.umask({umask}); from autotune.cli import main; main()"]
        + [*SIM, "--trials", "1", "--name", "m"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    root = tmp_path / "runs" / "m"
    for path in (
        root / "recipe.yaml",
        root / "report.html",
        root / "trials/0/outcome.json",
        root / "trials/0/params.json",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


# -- 10: a damaged trial file is said in one line and the trial is unknown, never fatal ------------
@pytest.mark.parametrize("damage", ['"extra": "x"', "cut short"])
def test_a_damaged_outcome_json_is_one_line_in_report_resume_and_show(runs, damage):
    outcome = runs / "base" / "trials" / "0" / "outcome.json"
    if damage == "cut short":
        outcome.write_text(outcome.read_text()[:40])
    else:
        outcome.write_text(json.dumps({**json.loads(outcome.read_text()), "extra": "x"}))
    for args in (["report", "base"], ["resume", "base", "--trials", "3"], ["show", "base"]):
        res = run_cli(*args, cwd=runs.parent)
        assert res.returncode == 0, (args, res.stderr)
        assert "Traceback" not in res.stderr, res.stderr
        said = [line for line in res.stderr.splitlines() if "outcome.json is damaged" in line]
        assert len(said) <= 1 and (said or args[0] == "show"), res.stderr
    launched = json.loads(run_cli("show", "base", "--json", cwd=runs.parent).stdout)
    assert sorted(r["number"] for r in launched) == [0, 1, 2]


def start_cli(*args, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune", *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- 9: exports at the same moment take turns ------------------------------------------------------
def test_exports_at_the_same_moment_all_succeed_and_leave_no_temp_folder(runs):
    before = (runs / "base" / "best" / "params.json").read_text()
    procs = [start_cli("export", "base", cwd=runs.parent) for _ in range(12)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert [rc for rc, _ in results] == [0] * 12, [err for _, err in results if err][:1]
    assert not list((runs / "base").glob(".best.tmp-*"))
    assert (runs / "base" / "best" / "params.json").read_text() == before


# -- 8: the same new study started twice at the same moment ----------------------------------------
def test_two_searches_of_one_new_study_started_together_share_it(tmp_path):
    procs = [start_cli(*SIM, "--trials", "2", "--name", "twin", cwd=tmp_path) for _ in range(3)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert [rc for rc, _ in results] == [0, 0, 0], [err for _, err in results if err][:1]
    assert all("Traceback" not in err and "alembic" not in err for _, err in results)
    db = tmp_path / "runs" / "twin" / "study.db"
    assert studies_in(db) == ["twin"]
    conn = sqlite3.connect(db)
    try:  # --trials is the study's total, whichever controller launched them
        launched = conn.execute(
            "SELECT COUNT(*) FROM trial_user_attributes WHERE key = 'launched' AND value_json = 'true'"
        ).fetchone()[0]
    finally:
        conn.close()
    assert launched == 2
