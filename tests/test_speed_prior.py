"""The speed prior against a GPU: what a micro-batch and transformers' generate cost.

The prior only orders candidates before trials measure them, but its order decides which regions a
search reaches (docs/benchmarks-notes.md reads misses by it). The measured side of these tests came
back from an H200 (tests/data/gpu/README.md, docs/gpu-validation.md's fourth lease): eager PyTorch
pays a launch floor per micro-step, so small micro-batches train far slower per sequence, and TRL
calls transformers' generate once per generation round, whatever the micro-batch. The prior once
charged training at one FLOP utilisation and TRL's generate once per micro-batch.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from statistics import fmean

import pytest

from autotune.candidate import speed
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model

DATA = Path(__file__).parent / "data" / "gpu"
H200 = find_gpu_type("H200")
PROMPT = COMPLETION = 128


def knobs(bs: int, ga: int, gc: bool = False) -> dict:
    return dict(
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        num_generations=4,
        gradient_checkpointing=gc,
        use_vllm=False,
    )


def generation_s(model, params: dict, half: int = PROMPT) -> float:
    """The prior's generation seconds of one step (prompt = completion = ``half``)."""
    completions = params["per_device_train_batch_size"] * params["gradient_accumulation_steps"]
    return speed._generation_time(
        model,
        params,
        H200,
        gpus=1,
        dp_gpus=1,
        completions=completions,
        seq=2 * half,
        completion=half,
        per_round=True,
    )


def train_s(model, params: dict, half: int = PROMPT) -> float:
    """The prior's training seconds: its step less its generation."""
    step = speed.step_time_prior(
        model, params, H200, gpus=1, dp_gpus=1, prompt=half, completion=half, per_round=True
    )
    return step - generation_s(model, params, half)


TRAIN_FILES = sorted(DATA.glob("microbatch_h200_*.json"))


def test_the_lease_s_files_are_all_read():
    """Five train files came back (0.5B, 1.5B, 7B at 256 tokens; 1.5B, 7B at 2048): a renamed one
    would drop its points from the test below without a failure."""
    assert [p.stem for p in TRAIN_FILES] == [
        "microbatch_h200_qwen2.5-0.5b",
        "microbatch_h200_qwen2.5-1.5b",
        "microbatch_h200_qwen2.5-1.5b_2048",
        "microbatch_h200_qwen2.5-7b",
        "microbatch_h200_qwen2.5-7b_2048",
    ]


@pytest.mark.parametrize("path", TRAIN_FILES, ids=lambda p: p.stem)
def test_a_small_micro_batch_trains_as_slowly_per_sequence_as_measured(path):
    """Per sequence, micro-batch b against the largest that ran, at one global batch: the prior's
    ratio within a factor of two of the H200's, for 0.5B, 1.5B and 7B at 128 + 128 tokens (1 is 26
    times slower than 32 for 0.5B) and 1.5B and 7B at 1024 + 1024 (1 is 1.1 times slower than 4 for
    7B), with and without checkpointing. A constant FLOP utilisation makes every ratio 1."""
    measured = json.loads(path.read_text())
    model, half = resolve_model(measured["meta"]["card"]), measured["meta"]["seq"] // 2
    checked = 0
    for gc in (False, True):
        rows = {
            r["batch"]: r["per_sequence_s"]
            for r in measured["rows"]
            if r["part"] == "train" and r["checkpointing"] == gc and "per_sequence_s" in r
        }
        top = max(rows)
        for batch, seconds in rows.items():
            want = seconds / rows[top]
            got = train_s(model, knobs(batch, top // batch, gc), half) / train_s(
                model, knobs(top, 1, gc), half
            )
            assert want / 2 <= got <= want * 2, (path.stem, gc, batch, want, got)
            checked += 1
    assert checked >= 7


def _trial(bs: int) -> tuple[float, float]:
    """Mean generation and training seconds of a TRL trial's measured steps (step 1 is warm-up)."""
    text = (DATA / f"trl_h200_qwen2.5-1.5b_mb{bs}.metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()][1:]
    return fmean(r["generation_time"] for r in rows), fmean(r["training_time"] for r in rows)


def test_transformers_generate_runs_once_per_generation_round():
    """TRL (read here in the installed source) samples bs x steps_per_generation prompts per round
    and hands them all to one ``generate`` call. So at one global batch, 2 x 16 generates no longer
    than 32 x 1 in the prior, as in the three TRL trials on the H200 (2 x 16's generation phase took
    1.3 times 32 x 1's); the old prior's 16 waves made it 16 times."""
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer.GRPOTrainer)
    assert "batch_size=self._train_batch_size * self.args.steps_per_generation" in source
    single = inspect.getsource(grpo_trainer.GRPOTrainer._generate_single_turn)
    assert single.count("unwrapped_model.generate(") == 1
    model = resolve_model("Qwen2.5-1.5B")
    (gen2, train2), (gen32, train32) = _trial(2), _trial(32)
    prior_gen = generation_s(model, knobs(2, 16)) / generation_s(model, knobs(32, 1))
    assert gen2 / gen32 / 1.5 <= prior_gen <= gen2 / gen32 * 1.5, (gen2, gen32, prior_gen)
    prior_train = train_s(model, knobs(2, 16)) / train_s(model, knobs(32, 1))
    assert train2 / train32 / 2 <= prior_train <= train2 / train32 * 2, (train2, train32, prior_train)


def test_the_runner_says_how_generate_is_called(recipe_factory):
    """TRL's runners (and the simulator of TRL) get the once-per-round generate; a ``--command``
    trainer, whose code the prior cannot read, keeps generate in waves of the micro-batch, the stand-in
    for the steep micro-batch efficiency the benchmark's PPO and plain trainers show
    (docs/benchmarks-notes.md, twenty-first pass): 2 x 16 against 32 x 1 there is 16 waves to 1."""
    from autotune.candidate.estimate import prior_for

    model = resolve_model("Qwen2.5-1.5B")

    def ratio(**kw) -> float:
        recipe = recipe_factory(
            gpus=1,
            gpu_type="H200",
            gpu_memory_gib=H200.memory_gib,
            max_prompt_length=PROMPT,
            max_completion_length=COMPLETION,
            **kw,
        )
        return prior_for(model, recipe, H200, knobs(32, 1)) / prior_for(model, recipe, H200, knobs(2, 16))

    (gen2, train2), (gen32, train32) = _trial(2), _trial(32)
    measured = (gen2 + train2) / (gen32 + train32)  # 32 x 1's throughput over 2 x 16's on the H200
    assert measured / 1.5 <= ratio(runner="trl") <= measured * 1.5, (measured, ratio(runner="trl"))
    assert ratio(runner="command", command="python train.py --bs {per_device_train_batch_size}") > 5


def test_a_round_said_as_generation_batch_size_charges_the_old_log_probs_alike():
    """TRL computes the old policy's log-probs when a generation round does not line up with the
    optimizer step. A round of 64 at micro-batch 8 and accumulation 2 is steps_per_generation 8
    whichever name the space uses; said as generation_batch_size, the prior once read it as aligned
    and left the pass out."""
    model = resolve_model("Qwen2.5-1.5B")
    aligned = train_s(model, knobs(8, 2))
    by_steps = train_s(model, {**knobs(8, 2), "steps_per_generation": 8})
    by_batch = train_s(model, {**knobs(8, 2), "generation_batch_size": 64})
    assert by_steps > aligned and by_batch == by_steps, (aligned, by_steps, by_batch)
