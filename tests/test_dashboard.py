"""``autotune dashboard``: the real optuna-dashboard on the README's sim search, asked over HTTP.

optuna-dashboard 0.21 picks as best the completed trial with the highest value, and reads trial
constraints from the ``constraints`` system attribute only. These tests start the real server on a
real SQLite study written by a real ``autotune search --runner sim`` and check that its best trial
is the one autotune exported, that every told trial shows its constraint, and that OOM, skipped and
passed-over trials can be told apart from their attributes. Without the optional extra the command
must say which extra to install, in one line, exit 2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli

from autotune.errors import UsageError
from autotune.recipe import Recipe

# the README's sim search (README.md, "Quick start"), time-compressed
README_SEARCH = [
    "search",
    "--model",
    "Qwen2.5-7B-Instruct",
    "--gpus",
    "4",
    "--runner",
    "sim",
    "--gpu-type",
    "A100-80GB",
    "--trials",
    "30",
    "--sim-time-scale",
    "0.0005",
    "--name",
    "readme",
]


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("dashboard")
    res = run_cli(*README_SEARCH, cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return cwd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read().decode())


@pytest.fixture(scope="module")
def server(study):
    """`autotune dashboard readme` as a user starts it, until the module's tests are done."""
    pytest.importorskip("optuna_dashboard")  # in the test extra: CI has it
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "dashboard", "readme", "--port", str(port)],
        cwd=study,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            get(f"{base}/api/studies")
            break
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"the dashboard did not start (exit {proc.returncode}): {out}\n{err}")
            time.sleep(0.3)
    yield base, proc
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def attrs(trial: dict) -> dict[str, str]:
    return {a["key"]: a["value"] for a in trial["user_attrs"]}


def detail(base: str) -> dict:
    studies = get(f"{base}/api/studies")["study_summaries"]
    (summary,) = [s for s in studies if s["study_name"] == "readme"]
    return get(f"{base}/api/studies/{summary['study_id']}")


def test_the_dashboards_best_trial_is_the_exported_one(study, server):
    base, proc = server
    shown = json.loads(run_cli("show", "readme", "--json", cwd=study).stdout)
    (exported,) = [t for t in shown if t["verdict"] == "exported"]
    params = json.loads((study / "runs" / "readme" / "best" / "params.json").read_text())
    assert exported["params"] == params

    data = detail(base)
    assert [t["number"] for t in data["best_trials"]] == [exported["number"]]
    assert attrs(data["best_trials"][0])["verdict"] == "exported"
    # the trial the plain dashboard would have named (highest value) is explained where it differs
    complete = [t for t in data["trials"] if t["state"] == "Complete"]
    top = max(complete, key=lambda t: t["values"][0])
    if top["number"] != exported["number"]:
        assert attrs(top)["verdict"].startswith(("passed over: ", "confirmed ")), attrs(top)
    # the server says where to look, once
    assert proc.poll() is None


def test_constraints_and_outcomes_are_readable(study, server):
    base, _ = server
    trials = detail(base)["trials"]
    statuses = set()
    for t in trials:
        a = attrs(t)
        statuses.add(a.get("status"))
        if t["state"] in ("Complete", "Pruned"):
            assert len(t["constraints"]) == 1, t["number"]  # the dashboard reads the list
            feasible = t["constraints"][0] <= 0
            assert feasible == (a["status"] == "ok" and not a["verdict"].startswith("passed over: peak")), a
        if a.get("status") == "oom":
            assert a["oom_kind"] in ("cuda", "host", "vllm_kv", "vllm_startup") and t["values"] == [0.0]
        if a.get("status") == "skipped":
            assert a["launched"] == "False" and a["reason"] and a["reason"] != "null"
    assert {"ok", "oom"} <= statuses, statuses
    # Optuna's own best trial is still the constrained one (the dashboard's storage does not change it)
    import optuna

    loaded = optuna.load_study(
        study_name="readme", storage=f"sqlite:///{study / 'runs' / 'readme' / 'study.db'}"
    )
    best = loaded.best_trial
    assert best.user_attrs["status"] == "ok" and all(v <= 0 for v in best.constraints.values())
    assert all(
        v > 0 for t in loaded.trials if t.user_attrs.get("status") == "oom" for v in t.constraints.values()
    )


def test_a_port_in_use_is_one_line(study, server):
    base, _ = server
    port = base.rsplit(":", 1)[1]
    res = run_cli("dashboard", "readme", "--port", port, cwd=study, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--port" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "Listening" not in res.stderr


# optuna_dashboard made unimportable for this one process, as on a machine without the extra
WITHOUT_EXTRA = textwrap.dedent("""\
    import runpy, sys

    class NoDashboard:
        def find_spec(self, name, path=None, target=None):
            if name == "optuna_dashboard" or name.startswith("optuna_dashboard."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoDashboard())
    sys.argv[0] = "autotune"
    runpy.run_module("autotune", run_name="__main__")
""")


def test_without_the_extra_the_command_names_it(study):
    res = subprocess.run(
        [sys.executable, "-I", "-c", WITHOUT_EXTRA, "dashboard", "readme"],
        cwd=study,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert "pip install 'autotune[dashboard]'" in res.stderr


# --- moved from test_review_fixes.py: PostgreSQL through the search's driver --------------------------------


def test_dashboard_on_postgresql_with_psycopg3_only_is_one_line(tmp_path, monkeypatch):
    """``postgresql://`` went to SQLAlchemy's default psycopg2 (not installed next to psycopg 3):
    a ModuleNotFoundError traceback. Through driver_url it is psycopg 3, and a server that is not
    there is one line."""
    pytest.importorskip("optuna_dashboard")
    pytest.importorskip("psycopg")
    from autotune.study import dashboard, storage
    from autotune.study.paths import StudyPaths

    monkeypatch.setattr(storage, "importable", lambda name: name == "psycopg")
    monkeypatch.setattr(dashboard, "_check_address", lambda host, port: None)
    recipe = Recipe(model="tiny-qwen", gpus=1, storage="postgresql://user:secret@127.0.0.1:9/none")
    with pytest.raises(UsageError) as caught:
        dashboard.serve(StudyPaths(tmp_path, "s"), recipe, port=0)
    text = caught.value.format_message()
    assert len(text.splitlines()) == 1 and "secret" not in text, text
    assert "psycopg2" not in text, text
    monkeypatch.setattr(storage, "importable", lambda name: False)
    with pytest.raises(UsageError, match="needs a PostgreSQL driver"):
        dashboard.serve(StudyPaths(tmp_path, "s"), recipe, port=0)
