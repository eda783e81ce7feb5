from pathlib import Path

import optuna
import pytest

from autotune.candidate.space import default_space_path
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_space_loads_with_fixed_names():
    space = load_space()
    assert default_space_path().resolve() == (ROOT / "search_spaces" / "grpo.yaml").resolve()
    for name in (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_generations",
        "zero_stage",
        "offload",
        "gradient_checkpointing",
        "vllm_gpu_memory_utilization",
        "vllm_enable_sleep_mode",
        "vllm_tensor_parallel_size",
    ):
        assert name in space.params
    assert space.params["offload"].choices == ("none", "optimizer", "optimizer+params")


def write(tmp_path, text):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text,expect",
    [
        ("parameters:\n  a:\n    type: int\n    choices: [1, 2\n", "invalid YAML"),
        (
            "parameters:\n  a:\n    type: integer\n    choices: [1]\n    default: 1\n",
            ":3: a.type is 'integer'",
        ),
        (
            "parameters:\n  a:\n    type: int\n    choices: [1, 2]\n    default: 3\n",
            ":5: a.default 3 is not one of 1, 2",
        ),
        (
            "parameters:\n  a:\n    type: int\n    choices: [1, x]\n    default: 1\n",
            ":4: a.choices has 'x', not a int",
        ),
        (
            "parameters:\n  a:\n    type: float\n    low: 0.9\n    high: 0.1\n    default: 0.5\n",
            ":4: a: low 0.9 is above high 0.1",
        ),
        (
            "parameters:\n  a:\n    type: int\n    choices: [1]\n    default: 1\n    colour: red\n",
            ":6: a: unknown key 'colour'",
        ),
        (
            "parameters:\n  a:\n    type: int\n    choices: [1]\n    default: 1\n    requires: {b: 1}\n",
            "requires names unknown parameter 'b'",
        ),
        ("version: 1\n", "non-empty 'parameters:'"),
    ],
)
def test_schema_errors_name_file_line_and_key(tmp_path, text, expect):
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as err:
        load_space(path)
    msg = str(err.value)
    assert str(path) in msg and expect in msg
    assert "\n" not in msg


def test_missing_space_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_space(tmp_path / "nope.yaml")


def test_pins_checked_against_definitions():
    space = load_space()
    space.check_pins({"num_generations": 8, "vllm_gpu_memory_utilization": 0.45})
    with pytest.raises(UsageError, match="unknown parameter"):
        space.check_pins({"batch": 4})
    with pytest.raises(UsageError, match="out of range.*one of 2, 4, 8, 16.*--space my_space.yaml"):
        space.check_pins({"num_generations": 3})
    with pytest.raises(UsageError, match="float from 0.2 to 0.9 in steps of 0.05"):
        space.check_pins({"vllm_gpu_memory_utilization": 0.95})
    with pytest.raises(UsageError):
        space.check_pins({"vllm_gpu_memory_utilization": 0.33})


def test_coerce_reads_cli_text():
    space = load_space()
    assert space.params["gradient_checkpointing"].coerce("false") is False
    assert space.params["vllm_gpu_memory_utilization"].coerce("1") == 1.0
    assert space.params["offload"].coerce("optimizer+params") == "optimizer+params"
    assert space.params["per_device_train_batch_size"].coerce("8") == 8


def test_normalize_drops_irrelevant_params():
    space = load_space()
    a = space.normalize({"use_vllm": False, "vllm_gpu_memory_utilization": 0.3})
    b = space.normalize({"use_vllm": False, "vllm_gpu_memory_utilization": 0.7})
    assert a == b and "vllm_gpu_memory_utilization" not in a
    c = space.normalize({"use_vllm": True, "vllm_gpu_memory_utilization": 0.30000000001})
    assert c["vllm_gpu_memory_utilization"] == 0.3


def test_suggest_respects_fixed_and_ranges():
    space = load_space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        trial = study.ask()
        values = space.suggest(trial, {"num_generations": 8})
        assert values["num_generations"] == 8 and "num_generations" not in trial.params
        for name, value in values.items():
            assert space.params[name].contains(value), (name, value)
        study.tell(trial, 1.0)


def test_shipped_space_offers_two_generations_and_points_at_a_copy(tmp_path):
    space = load_space()
    assert 2 in space.params["num_generations"].choices
    with pytest.raises(UsageError) as exc:
        space.check_pins({"zero_stage": 4})
    assert "--space my_space.yaml" in str(exc.value) and "cp " in str(exc.value)
    copy = tmp_path / "mine.yaml"
    copy.write_text(space.path.read_text())
    with pytest.raises(UsageError, match=f"widen it in {copy}, the file given to --space"):
        load_space(copy).check_pins({"zero_stage": 4})


def test_outside_warns_for_the_right_type_and_refuses_the_wrong_one():
    space = load_space()
    assert space.outside({"use_vllm": False, "num_generations": 8}) == [
        "--set use_vllm=false is outside the space (use_vllm is one of true); estimated anyway"
    ]
    with pytest.raises(UsageError, match="takes int values"):
        space.outside({"num_generations": "many"})


MAPPED = (
    "parameters:\n  mb:\n    type: int\n    choices: [1, 2]\n    default: 1\n"
    "  ga:\n    type: int\n    choices: [1, 2]\n    default: 1\n"
    "  lr:\n    type: float\n    choices: [0.1]\n    default: 0.1\n"
)


def test_global_batch_block_names_the_batch_parameters(tmp_path):
    space = load_space(
        write(tmp_path, "global_batch: {micro_batch: mb, accumulation: ga, per: all}\n" + MAPPED)
    )
    batch = space.batch
    assert (batch.micro_batch, batch.accumulation, batch.per, batch.generations, batch.declared) == (
        "mb",
        "ga",
        "all",
        None,
        True,
    )
    assert batch.completions({"mb": 2, "ga": 2}, dp=4) == 4  # per: all counts every GPU already
    assert load_space(write(tmp_path, MAPPED)).batch is None  # own names, nothing declared
    assert load_space().batch.micro_batch == "per_device_train_batch_size"  # TRL's names need no block


@pytest.mark.parametrize(
    "block,expect",
    [
        ("global_batch: {micro_batch: lr}\n", ":1: global_batch.micro_batch is 'lr', not an int parameter"),
        (
            "global_batch:\n  micro_batch: mb\n  accumulation: nope\n",
            ":3: global_batch.accumulation is 'nope'",
        ),
        ("global_batch:\n  micro_batch: mb\n  per: node\n", ":3: global_batch.per is 'node'; allowed: gpu"),
        ("global_batch:\n  micro_batch: mb\n  colour: red\n", ":3: global_batch: unknown key 'colour'"),
        ("global_batch: [mb, ga]\n", ":1: global_batch needs 'micro_batch'"),
        (
            "global_batch: {micro_batch: mb, generations: mb}\n",
            ":1: global_batch: micro_batch, accumulation and",
        ),
    ],
)
def test_global_batch_block_errors_name_file_and_line(tmp_path, block, expect):
    path = write(tmp_path, block + MAPPED)
    with pytest.raises(UsageError) as err:
        load_space(path)
    assert str(path) in str(err.value) and expect in str(err.value) and "\n" not in str(err.value)


def test_a_stepped_knob_of_few_values_is_on_the_planners_grid_whole():
    """The planner's pool takes 5 points of a continuous knob. For a vLLM fraction of 0.3-0.9 by 0.1
    the 5 evenly spaced points snapped to the step were 0.3, 0.5, 0.6, 0.7, 0.9: no candidate of the
    pool (seeds, the grid's best open candidate, the convergence test) had 0.4 or 0.8, where the
    benchmark's PPO #64 has its best configuration."""
    from autotune.search.planner import GRID_FLOAT_POINTS

    ppo = load_space(Path(__file__).parents[1] / "autotune" / "sim" / "spaces" / "ppo.yaml")
    fractions = {c["vllm_gpu_memory_utilization"] for c in ppo.grid({}, float_points=GRID_FLOAT_POINTS)}
    assert sorted(fractions) == [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    # a knob with many steps keeps its few evenly spaced points (the pool's size)
    grpo = load_space(default_space_path())
    assert len(grpo.params["vllm_gpu_memory_utilization"].grid_values(GRID_FLOAT_POINTS)) == 5
