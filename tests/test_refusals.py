"""A value the trainer refused by name is learned from a crash's error line (search/refusals.py).

The error texts are the libraries' own, as users reported them: Megatron-Core's TransformerConfig
(``num_attention_heads (28) must be a multiple of tensor_model_parallel_size (8).``, and the same
check of ``num_query_groups``), vLLM's head check, Megatron-Core's sequence-parallel check, DeepSpeed's
batch check, and NCCL's watchdog (c10::DistBackendError)."""

from __future__ import annotations

import pytest

from autotune.errors import SearchStopped
from autotune.search.planner import Planner
from autotune.search.refusals import Refusals, named
from autotune.search.transient import Reruns

MEGATRON = "ValueError: num_attention_heads (28) must be a multiple of tensor_model_parallel_size (8)."
GQA = "ValueError: num_query_groups (4) must be a multiple of tensor_model_parallel_size (8)."
VLLM = "ValueError: Total number of attention heads (28) must be divisible by tensor parallel size (3)."
SP = "ValueError: Cannot use sequence parallelism without tensor parallelism"
DEEPSPEED = (
    "AssertionError: Check batch related parameters. train_batch_size is not equal to "
    "micro_batch_per_gpu * gradient_acc_step * world_size 16 != 2 * 4 * 1"
)
NCCL = (
    "terminate called after throwing an instance of 'c10::DistBackendError' what(): [PG ID 0 Rank 1] "
    "Watchdog caught collective operation timeout: tensor_model_parallel_size 8"
)

TP8 = {"tensor_model_parallel_size": 8, "train_micro_batch_size": 8, "sequence_parallel": True}


def test_the_line_names_the_knob_with_the_candidate_s_value():
    assert named(MEGATRON, TP8) == {"tensor_model_parallel_size": 8}
    assert named(GQA, TP8) == {"tensor_model_parallel_size": 8}
    # another value than the candidate's, or a name that is not the space's, names nothing
    assert named(MEGATRON, {**TP8, "tensor_model_parallel_size": 4}) == {}
    assert named(VLLM, {"vllm_tensor_parallel_size": 3}) == {}
    assert named(SP, TP8) == {}
    assert named(DEEPSPEED, {"train_batch_size": 16, "gradient_accumulation_steps": 4}) == {}
    # a value is a whole token: 8 is not 8.5 nor 80, and a knob's name is not a longer name's part
    assert named("ValueError: tensor_model_parallel_size (80) is too large", TP8) == {}
    assert named("ValueError: tensor_model_parallel_size=8.5 is not an integer", TP8) == {}
    assert named("ValueError: vllm_tensor_model_parallel_size=8 is refused", TP8) == {}
    # forms a trainer prints a setting in; a boolean in either case; two knobs named are both kept
    assert named("tensor_model_parallel_size=8 is refused", TP8) == {"tensor_model_parallel_size": 8}
    assert named("sequence_parallel: true needs TP", TP8) == {"sequence_parallel": True}
    both = "train_micro_batch_size (8) exceeds what tensor_model_parallel_size=8 allows"
    assert named(both, TP8) == {"tensor_model_parallel_size": 8, "train_micro_batch_size": 8}
    # no sign or comparison between name and value, no longer token after it, no empty value
    assert named("ValueError: tensor_model_parallel_size (-8) is negative", TP8) == {}
    assert named("ValueError: tensor_model_parallel_size > 8 is not supported", TP8) == {}
    assert named("ValueError: max_steps=-1 needs a dataset length", {"max_steps": 1}) == {}
    assert named("ValueError: tensor_model_parallel_size 8-way split failed", TP8) == {}
    assert named("ValueError: offload_device=cpu/nvme unknown", {"offload_device": "cpu"}) == {}
    assert named("ValueError: offload_device=cpu unknown", {"offload_device": "cpu"}) == {
        "offload_device": "cpu"
    }
    assert named("ValueError: prefix= is empty", {"prefix": ""}) == {}
    assert named("ValueError: vllm_mode='server' needs GPUs left", {"vllm_mode": "server"}) == {
        "vllm_mode": "server"
    }
    # a known transient class is never a refusal, whatever it prints
    assert named(NCCL, TP8) == {}
    assert named(None, TP8) == {}


def test_a_refusal_rules_out_every_candidate_holding_the_named_values_until_one_of_them_runs():
    refusals = Refusals()
    refusals.learn(3, TP8, MEGATRON, searched=set(TP8))
    refusals.learn(4, TP8, SP, searched=set(TP8))  # names nothing: learns nothing
    # a pinned knob's value is not learned: refusing it would refuse every candidate, where three
    # crashes alike stop the search with the trainer's own line instead
    refusals.learn(5, TP8, MEGATRON, searched={"train_micro_batch_size", "sequence_parallel"})
    assert len(refusals.learned) == 1
    other = {"tensor_model_parallel_size": 8, "train_micro_batch_size": 1, "sequence_parallel": False}
    why = refusals.reason(other)
    assert why is not None and "tensor_model_parallel_size=8 in trial 3" in why and MEGATRON in why
    assert refusals.reason({**other, "tensor_model_parallel_size": 4}) is None
    # a success with the named value contradicts it: the refusal depended on something else too
    assert refusals.reason(other, ran=[{**other, "train_micro_batch_size": 2}]) is None


def test_the_planner_skips_what_was_refused_and_a_refusal_is_not_re_run():
    from autotune.candidate.space_file import load_space
    from autotune.hardware import find_gpu_type
    from autotune.models import resolve_model
    from autotune.recipe import Recipe

    gpu = find_gpu_type("H100-80GB")
    recipe = Recipe(model="Qwen2.5-7B-Instruct", gpus=8, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib)
    planner = Planner(resolve_model(recipe.model), recipe, gpu)
    base = {**load_space().defaults(), "vllm_tensor_parallel_size": 8}
    line = "ValueError: vllm_tensor_parallel_size (8) must divide the number of attention heads (28)"
    planner.refusals.learn(3, base, line, searched=set(base))
    verdict = planner.verdict({**base, "per_device_train_batch_size": 2})
    assert verdict.skip and "refused vllm_tensor_parallel_size=8" in (verdict.reason or "")
    assert not planner.verdict({**base, "vllm_tensor_parallel_size": 4}).skip
    # a neighbour that ran fine makes a crash worth a second run, unless the crash named its values
    fine = [{**base, "vllm_tensor_parallel_size": 4}]
    reruns = Reruns()
    assert not reruns.consider("a", base, line, None, fine)
    assert reruns.consider("b", base, "RuntimeError: something else broke", None, fine)


def test_a_pinned_value_the_trainer_refuses_stops_the_search_with_the_trainer_s_line(tmp_path):
    """A refusal of a value the user pinned would refuse every candidate and end the search as if
    the space were used up, after one trial. Only the knobs the search varies are learned; three
    crashes alike stop it with the trainer's own line, which names what to change."""
    from conftest import make_search

    from autotune.trial.outcome import Outcome

    line = "ValueError: vllm_tensor_parallel_size (8) must divide the number of attention heads (28)"

    def refused(params, trial_dir, number, control):
        return Outcome(status="crash", error_line=line, steps=0, wall_time_s=1.0)

    search = make_search(
        tmp_path,
        model="Qwen2.5-7B-Instruct",
        gpu_name="H100-80GB",
        execute=refused,
        trials=10,
        confirm=0,
        pins={"vllm_tensor_parallel_size": 8},
    )
    with pytest.raises(
        SearchStopped, match=r"the same crash 3 times in a row: ValueError: vllm_tensor"
    ) as stop:
        search.run()
    assert "fix it, then autotune resume" in str(stop.value)
    assert sorted(d.name for d in (tmp_path / "r" / "trials").iterdir()) == ["0", "1", "2"]
