import pytest

from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError

OK = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_generations=8,
    zero_stage=3,
    offload="none",
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.4,
    vllm_tensor_parallel_size=1,
)


def test_valid_candidate_has_no_violations(recipe_factory):
    assert constraints.violations(OK, recipe_factory()) == []


@pytest.mark.parametrize(
    "change,fragment",
    [
        (
            dict(per_device_train_batch_size=1, gradient_accumulation_steps=1),
            "not divisible by num_generations 8",
        ),
        (dict(num_generations=1), "at least 2"),
        (dict(zero_stage=1, offload="optimizer"), "optimizer offload needs ZeRO stage 2 or 3"),
        (dict(zero_stage=2, offload="optimizer+params"), "parameter offload needs ZeRO stage 3"),
        (dict(vllm_tensor_parallel_size=3), "must divide the 4 GPU"),
    ],
)
def test_each_rule(recipe_factory, change, fragment):
    broken = constraints.violations({**OK, **change}, recipe_factory())
    assert any(fragment in b for b in broken), broken


def test_tensor_parallel_ignored_without_vllm(recipe_factory):
    assert (
        constraints.violations({**OK, "use_vllm": False, "vllm_tensor_parallel_size": 3}, recipe_factory())
        == []
    )


def test_global_batch_derives_accumulation(recipe_factory):
    recipe = recipe_factory(global_batch=256)
    out = constraints.derive({**OK, "per_device_train_batch_size": 8}, recipe)
    assert out["gradient_accumulation_steps"] == 8  # 256 / (8 x 4)
    bad = constraints.derive({**OK, "per_device_train_batch_size": 3}, recipe)
    assert any("global batch 256 is not divisible" in v for v in constraints.violations(bad, recipe))


def test_server_mode_takes_gpus_from_training(recipe_factory):
    recipe = recipe_factory()
    params = {
        **OK,
        "vllm_mode": "server",
        "vllm_tensor_parallel_size": 1,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
    }
    assert recipe.dp_gpus(params) == 3
    assert constraints.violations(params, recipe) == []  # 8 x 3 = 24, divisible by 8
    assert constraints.violations({**params, "vllm_tensor_parallel_size": 4}, recipe)


def test_pins_that_leave_nothing_name_the_rule(recipe_factory):
    space = load_space()
    recipe = recipe_factory(gpus=1)
    # one GPU, batch 1, accumulation 1: generation batch 1 can never hold 4+ generations
    with pytest.raises(UsageError, match="divisible by num_generations"):
        constraints.check_pins_leave_candidates(
            space, recipe, {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
        )
    with pytest.raises(UsageError, match="parameter offload needs ZeRO stage 3"):
        constraints.check_pins_leave_candidates(
            space, recipe_factory(), {"zero_stage": 2, "offload": "optimizer+params"}
        )
    assert constraints.check_pins_leave_candidates(space, recipe_factory(), {}) > 100


def test_generation_batch_rule_agrees_with_the_real_grpo_config(recipe_factory, tmp_path):
    """TRL's own GRPOConfig decides: a space that sets steps_per_generation or generation_batch_size
    is judged as TRL judges it (bs 2, GA 4, spg 1, G 8 is refused by TRL; bs 2, GA 1, spg 4, G 8 runs)."""
    import itertools
    import warnings

    import trl

    recipe = recipe_factory(gpus=1)
    disagree = []
    for bs, ga, spg, gbs, gens in itertools.product([1, 2, 4], [1, 4], [None, 1, 4], [None, 6, 8], [2, 8]):
        params = {
            **OK,
            "per_device_train_batch_size": bs,
            "gradient_accumulation_steps": ga,
            "num_generations": gens,
            "use_vllm": False,
            "zero_stage": 0,
        }
        extra = {
            k: v for k, v in (("steps_per_generation", spg), ("generation_batch_size", gbs)) if v is not None
        }
        ours = constraints.violations({**params, **extra}, recipe)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trl.GRPOConfig(
                    output_dir=str(tmp_path),
                    per_device_train_batch_size=bs,
                    gradient_accumulation_steps=ga,
                    num_generations=gens,
                    use_cpu=True,
                    bf16=False,
                    report_to=[],
                    **extra,
                )
            refused = None
        except ValueError as exc:
            refused = str(exc)
        if bool(ours) != (refused is not None):
            disagree.append((bs, ga, spg, gbs, gens, ours, refused))
    assert not disagree, disagree[:5]
    named = constraints.violations(
        {
            **OK,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "steps_per_generation": 1,
            "num_generations": 8,
        },
        recipe,
    )
    assert named and "2 per device x 1 GPUs x 1 steps_per_generation" in named[0]
    assert (
        constraints.violations(
            {
                **OK,
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 1,
                "steps_per_generation": 4,
                "num_generations": 8,
            },
            recipe,
        )
        == []
    )


def test_rules_given_the_space_explicitly_agree_with_the_recipes_own(recipe_factory):
    """Callers holding the Space pass it; the others get the recipe's space, loaded once: same verdicts."""
    space = load_space()
    recipe = recipe_factory(global_batch=64)
    for pdbs in (1, 2, 3, 4, 8, 16):
        cand = {**OK, "per_device_train_batch_size": pdbs}
        assert constraints.derive(cand, recipe, space) == constraints.derive(cand, recipe)
        derived = constraints.derive(cand, recipe)
        assert constraints.violations(derived, recipe, space=space) == constraints.violations(derived, recipe)
    assert (
        constraints.violations(
            {**OK, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 0}, recipe
        )[0]
        == "global batch 64 is not divisible by per-device batch 3 x 4 data-parallel GPUs"
    )
