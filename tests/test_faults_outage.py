"""Issue 22, items 6 and 7: the storage goes away mid-search (an SQLite write lock another program
holds). An outage shorter than the limit is waited out with a line saying so; a longer one ends the
search with one line and the study is resumable. Real sim searches on real SQLite files."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SIM, run_cli


def search_holding_a_lock(tmp_path: Path, hold_s: float, limit_s: float | None) -> tuple[int, str]:
    """A search whose study.db is locked (BEGIN EXCLUSIVE) for ``hold_s`` once a trial has ended."""
    env = {**os.environ}
    if limit_s is not None:
        env["AUTOTUNE_STORAGE_OUTAGE_S"] = str(limit_s)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", *SIM, "--sim-time-scale", "0.01", "--trials", "4", "--name", "lk"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    root = tmp_path / "runs" / "lk"
    deadline = time.monotonic() + 300
    while not list(root.glob("trials/*/outcome.json")):
        assert proc.poll() is None and time.monotonic() < deadline, "the search ended before a trial did"
        time.sleep(0.05)
    conn = sqlite3.connect(root / "study.db", timeout=60, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    time.sleep(hold_s)
    conn.execute("ROLLBACK")
    conn.close()
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def test_a_write_lock_longer_than_the_limit_ends_with_one_line_and_resume_goes_on(tmp_path):
    rc, err = search_holding_a_lock(tmp_path, hold_s=12, limit_s=2)
    assert rc == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert "unreachable for" in last and "continue with autotune resume" in last, err
    res = run_cli("resume", "lk", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert len([p for p in (tmp_path / "runs/lk/trials").iterdir() if p.name.isdigit()]) >= 4


@pytest.mark.slow
def test_a_write_lock_of_75_s_is_waited_out_by_default(tmp_path):
    """Longer than SQLite's own wait (10 s) and than the heartbeats' grace (60 s): a line when it
    starts, one when the database is back, and the search goes on."""
    rc, err = search_holding_a_lock(tmp_path, hold_s=75, limit_s=None)
    assert rc == 0, err
    assert "Traceback" not in err, err
    assert "is unreachable (database is locked); waiting up to 5 min" in err, err
    assert "is back after" in err, err
