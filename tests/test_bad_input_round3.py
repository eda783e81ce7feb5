"""Issue 22, items 11 and 12: bad input gets one line and exit 2 before anything is written, and a
study's space file is found by its absolute path and checked against its digest on resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ROOT, SIM, one_line_error, run_cli

SPACE = ROOT / "autotune" / "spaces" / "grpo.yaml"


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--seed", "-5"], "--seed -5"),
        (["--seed", str(2**32)], "from 0 to 4294967295"),
        (["--sim-time-scale", "-1"], "--sim-time-scale"),
        (["--sim-time-scale", "0"], "--sim-time-scale"),
        (["--sim-time-scale", "nan"], "--sim-time-scale"),
        (["--runner", "command", "--command", "echo {per_device_train_batch_size:>140000}"], "140000"),
        (
            ["--runner", "command", "--command", "echo {per_device_train_batch_size:=^99999999999}"],
            "99999999999",
        ),
    ],
)
def test_bad_flags_are_one_line_before_anything_is_written(tmp_path, flags, fragment):
    res = run_cli(*SIM, "--trials", "1", "--name", "x", *flags, cwd=tmp_path)
    one_line_error(res, fragment)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (
            lambda t: t.replace(
                "parameters:\n", "parameters:\n  zero_stage: {type: int, choices: [0], default: 0}\n", 1
            ),
            "written twice",
        ),
        (
            lambda t: t.replace(
                "requires: {use_vllm: true}", "requires: {use_vllm: true, vllm_mode: colocate}", 1
            ).replace("use_vllm:\n", "use_vllm:\n    requires: {vllm_gpu_memory_utilization: 0.35}\n", 1),
            "circle",
        ),
    ],
)
def test_a_space_with_a_duplicate_key_or_circular_requires_is_refused(tmp_path, edit, fragment):
    text = SPACE.read_text()
    changed = edit(text)
    assert changed != text
    (tmp_path / "space.yaml").write_text(changed)
    res = run_cli(*SIM, "--trials", "1", "--name", "x", "--space", "space.yaml", cwd=tmp_path)
    one_line_error(res, "space.yaml:", fragment)
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def spaced(tmp_path) -> Path:
    """A one-trial study started with a relative --space path."""
    shutil.copy(SPACE, tmp_path / "space.yaml")
    res = run_cli(*SIM, "--trials", "1", "--name", "sp", "--space", "space.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return tmp_path


def test_a_relative_space_path_resumes_from_another_folder_and_an_edited_space_is_refused(
    spaced, tmp_path_factory
):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "space.yaml").write_text(SPACE.read_text() + "# another space\n")
    runs = spaced / "runs"
    res = run_cli("resume", "sp", "--runs-dir", runs, "--trials", "2", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    with open(spaced / "space.yaml", "a") as fh:
        fh.write("# edited\n")
    before = (runs / "sp" / "recipe.yaml").read_text()
    res = run_cli("resume", "sp", "--runs-dir", runs, "--trials", "3", cwd=elsewhere)
    one_line_error(res, "is not the one this study was started with", "restore that file")
    assert (runs / "sp" / "recipe.yaml").read_text() == before


@pytest.mark.parametrize("edit", ["wrong type", "removed key"])
def test_a_recipe_yaml_with_a_wrong_type_or_a_removed_key_is_one_line(spaced, edit):
    recipe = spaced / "runs" / "sp" / "recipe.yaml"
    lines = recipe.read_text().splitlines()
    if edit == "wrong type":
        lines = [("gpus: four" if line.startswith("gpus:") else line) for line in lines]
    else:
        lines = [line for line in lines if not line.startswith("gpus:")]
    recipe.write_text("\n".join(lines) + "\n")
    for args in (["resume", "sp"], ["show", "sp"]):
        one_line_error(run_cli(*args, cwd=spaced), "recipe.yaml: 'gpus' is")
