"""A space's own validity rules (``rules:``, candidate/space_rules.py): read once when the space loads,
a broken one marks a candidate invalid before it runs, and a rule that cannot be read is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SIM, one_line_error, run_cli

from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError

MEGATRON = """version: 1
parameters:
  tp: {type: int, choices: [1, 2, 4, 8], default: 2}
  pp: {type: int, choices: [1, 2, 4], default: 1}
  sequence_parallel: {type: bool, choices: [true, false], default: true}
  checkpointing: {type: bool, choices: [true, false], default: true}
  granularity: {type: categorical, choices: [full, selective], default: full,
                requires: {checkpointing: true}}
rules:
  - gpus % (tp * pp) == 0
  - sequence_parallel == false or tp > 1
  - granularity in ['full', 'selective'] if checkpointing else true
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_a_broken_rule_marks_the_candidate_invalid_with_the_rule_s_text(tmp_path, recipe_factory):
    path = write(tmp_path, MEGATRON)
    space = load_space(path)
    assert [r.text for r in space.rules][:2] == [
        "gpus % (tp * pp) == 0",
        "sequence_parallel == false or tp > 1",
    ]
    recipe = recipe_factory(gpus=8, space=str(path), runner="command", command="t")
    ok = space.normalize({"tp": 2, "pp": 4, "sequence_parallel": True, "checkpointing": False})
    assert constraints.violations(ok, recipe, space=space) == []
    assert constraints.violations({**ok, "tp": 4}, recipe, space=space) == [
        "breaks the space's rule gpus % (tp * pp) == 0"
    ]
    assert constraints.violations({**ok, "tp": 1}, recipe, space=space) == [
        "breaks the space's rule sequence_parallel == false or tp > 1"
    ]
    # the recipe's space is read when a caller holds none (the search's proposers do so)
    assert constraints.violations({**ok, "tp": 4}, recipe) == [
        "breaks the space's rule gpus % (tp * pp) == 0"
    ]
    # gpus is the node's: on 4 GPUs 2 x 4 does not divide
    assert constraints.violations(ok, recipe_factory(gpus=4, space=str(path)), space=space)
    valid, blocked = constraints.valid_combinations(space, recipe, {})
    layouts = {(c["tp"], c["pp"], c["sequence_parallel"]) for c in valid}
    assert (8, 1, True) in layouts and (2, 4, False) in layouts
    assert not any(tp * pp > 8 or (sp and tp == 1) for tp, pp, sp in layouts)
    assert sum(blocked.values()) > 0


@pytest.mark.parametrize(
    "rule,expect",
    [
        ("gpus % (tp * pp == 0", "is not a Python expression"),
        ("tp * width == 8", "'width' is neither a parameter of this space nor gpus"),
        ("__import__('os').system('true')", "Call is not allowed"),
        ("tp.real > 1", "Attribute is not allowed"),
        ("[tp][0] > 1", "Subscript is not allowed"),
        ("(lambda: 1)()", "is not allowed"),
        ("", "is not an expression"),
        ("not " * 3000 + "tp", "characters long; write rules of at most 500"),
        ("granularity > 1", "cannot be computed at the parameters' defaults"),
    ],
)
def test_a_rule_that_cannot_be_read_is_one_line_with_file_and_line(tmp_path, rule, expect):
    path = write(tmp_path, MEGATRON + f'  - "{rule}"\n')
    with pytest.raises(UsageError) as err:
        load_space(path)
    msg = str(err.value)
    assert f"{path}:13: rules[3]:" in msg and expect in msg and "\n" not in msg, msg


def test_rules_that_are_not_a_list_are_refused(tmp_path):
    path = write(tmp_path, MEGATRON.split("rules:")[0] + "rules: gpus % tp == 0\n")
    with pytest.raises(UsageError, match=r":9: rules: is a list of expressions"):
        load_space(path)


def test_a_rule_that_cannot_be_computed_for_a_candidate_breaks(tmp_path, recipe_factory):
    path = write(tmp_path, MEGATRON.split("rules:")[0] + "rules:\n  - gpus // (tp - 1) >= 1\n")
    space = load_space(path)
    recipe = recipe_factory(gpus=8, space=str(path))
    assert constraints.violations({"tp": 1, "pp": 1}, recipe, space=space)  # division by zero
    assert not constraints.violations({"tp": 2, "pp": 1}, recipe, space=space)
    # arithmetic is on numbers only: a list times a large number is not built; the space is refused
    path = write(tmp_path, MEGATRON.split("rules:")[0] + "rules:\n  - '[tp] * 10000000000 != [2]'\n")
    with pytest.raises(UsageError, match="cannot be computed at the parameters' defaults"):
        load_space(path)


def test_the_cli_refuses_a_space_with_an_unreadable_rule_in_one_line(tmp_path):
    path = write(tmp_path, MEGATRON + "  - tp * nodes == 8\n")
    res = run_cli(*SIM, "--space", path, "--trials", "1", cwd=tmp_path)
    one_line_error(res, str(path), "rules[3]", "'nodes' is neither a parameter")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_misspelt_top_level_key_and_a_parameter_named_like_the_rules_own_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r":9: unknown key 'rule'; allowed: version, parameters"):
        load_space(write(tmp_path, MEGATRON.replace("rules:", "rule:")))
    clash = MEGATRON.replace("  tp: {", "  gpus: {type: int, choices: [1], default: 1}\n  tp: {")
    with pytest.raises(UsageError, match=r"rules\[0\]: a parameter named 'gpus' cannot be told apart"):
        load_space(write(tmp_path, clash))


def test_a_rule_over_a_float_is_checked_on_candidates_not_on_its_three_grid_points(tmp_path, recipe_factory):
    """A float's grid is three points, not its range: a rule over one must neither pin it to the one
    grid point it keeps nor refuse pins as leaving nothing valid."""
    text = MEGATRON.split("rules:")[0].replace(
        "parameters:\n",
        "parameters:\n  lr: {type: float, low: 1.0e-6, high: 1.0e-4, log: true, default: 1.0e-5}\n",
    )
    path = write(tmp_path, text + "rules:\n  - lr > 6.0e-5 and lr < 9.0e-5\n")
    space = load_space(path)
    recipe = recipe_factory(gpus=8, space=str(path))
    valid, _ = constraints.valid_combinations(space, recipe, {})
    assert valid and constraints.forced_values(space, valid) == {}
    constraints.check_pins_leave_candidates(space, recipe, {})
    assert constraints.violations({"lr": 1e-5, "tp": 2}, recipe, space=space)
    assert not constraints.violations({"lr": 7e-5, "tp": 2}, recipe, space=space)
