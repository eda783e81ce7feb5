"""`autotune run`'s restart rule, fast: which measured configuration a production run restarts on
for each kind of failure (the real planner's dominance on the real search space), and which
checkpoint it resumes from. The end-to-end runs are in tests/test_production.py."""

import json

from conftest import COLOCATED

from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.production.checkpoints import checkpoints, newest
from autotune.production.choice import restart_choice
from autotune.recipe import Recipe
from autotune.search.planner import Planner
from autotune.study import TrialRow
from autotune.study.incidents import Incident

FAILED = dict(COLOCATED)  # a copy: a test that changed it would change no other module
SMALLER_BATCH = {**FAILED, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8}
MORE_KV = {**FAILED, "vllm_gpu_memory_utilization": 0.6}  # more room for vLLM's KV cache
LESS_VLLM = {**FAILED, "vllm_gpu_memory_utilization": 0.3}  # leaves the trainer more at start-up
BIGGER_BATCH = {**FAILED, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}


def setup(device="cuda"):
    gpu = find_gpu_type("A100-80GB")
    recipe = Recipe(
        model="Qwen2.5-7B-Instruct", gpus=4, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib, device=device
    )
    return recipe, Planner(resolve_model(recipe.model), recipe, gpu, use_model=device != "cpu")


def measured(*configs):
    return [TrialRow(n, p, "ok", throughput=t) for n, (p, t) in enumerate(configs)]


ROWS = measured((BIGGER_BATCH, 20.0), (SMALLER_BATCH, 11.5), (MORE_KV, 12.0), (LESS_VLLM, 11.0))


def choose(status, kind, rows=ROWS, history=(), device="cuda"):
    recipe, planner = setup(device)
    return restart_choice(
        FAILED,
        status,
        kind,
        rows=rows,
        history=list(history),
        planner=planner,
        space=load_space(),
        fixed={},
        rules=[],
    )


def test_each_failure_kind_restarts_on_the_fastest_measured_config_safer_in_its_own_knobs():
    cuda = choose("oom", "cuda")  # the trainer's peak: the faster batch-8 trial needs more, never chosen
    assert cuda.params == SMALLER_BATCH and cuda.source.startswith("trial 1") and not cuda.probe
    kv = choose("oom", "vllm_kv")  # the batch does not matter; a larger KV fraction does
    assert kv.params == MORE_KV and kv.source.startswith("trial 2")
    startup = choose("oom", "vllm_startup")  # a smaller fraction beside the same trainer state
    assert startup.params == LESS_VLLM and startup.source.startswith("trial 3")
    hang = choose("hang", None)  # judged like a CUDA OOM: every knob
    assert hang.params in (SMALLER_BATCH, LESS_VLLM) and hang.params == cuda.params


def test_host_oom_on_cpu_takes_the_smaller_batch_and_keeps_the_global_batch():
    recipe, _ = setup("cpu")
    rows = measured((BIGGER_BATCH, 20.0), ({**SMALLER_BATCH, "gradient_accumulation_steps": 1}, 11.5))
    choice = choose("oom", "host", rows=rows, device="cpu")
    assert choice.params["per_device_train_batch_size"] == 2
    space = load_space()
    assert constraints.samples_per_step(choice.params, recipe, space) == constraints.samples_per_step(
        FAILED, recipe, space
    )  # the accumulation was raised to 8 so each optimizer step trains as many completions
    assert choice.params["gradient_accumulation_steps"] == 8


def test_a_trial_the_pruner_stopped_is_measured_enough_to_restart_on():
    """Seen in CI on a loaded machine: the study's batch-4 trial was pruned (under half the batch-8
    trial's throughput while other processes took the cores), so after batch 8 ran out of host
    memory the run probed a configuration the study had already run without running out of memory."""
    import dataclasses

    rows = [dataclasses.replace(r, pruned=r.params == SMALLER_BATCH) for r in ROWS]
    choice = choose("oom", "cuda", rows=rows)
    assert choice.params == SMALLER_BATCH and not choice.probe, choice


def test_a_crash_or_timeout_restarts_on_the_same_configuration():
    for status in ("crash", "timeout"):
        choice = choose(status, None)
        assert choice.params == FAILED and choice.source == "same configuration"


def test_a_config_a_long_run_already_lost_is_not_chosen_again_and_none_left_proposes_a_probe():
    lost = Incident(1, 1, "oom", "cuda", 8, "CUDA out of memory", dict(SMALLER_BATCH))
    after = choose("oom", "cuda", history=[lost])  # batch 2 died before: the lighter vLLM is next
    assert after.params == LESS_VLLM
    probe = choose("oom", "cuda", rows=measured((BIGGER_BATCH, 20.0)))  # nothing measured is safer
    assert probe is not None and probe.probe and "short trial" in probe.source
    changed = {k for k in FAILED if probe.params.get(k) != FAILED[k]}
    assert changed and changed != {"gradient_accumulation_steps"}  # a real step down, batch kept


def test_the_newest_complete_checkpoint_is_resumed_and_none_is_touched(tmp_path):
    first = tmp_path / "attempts" / "1"
    for step in range(1, 8):  # a template trainer's checkpoints
        (first / f"checkpoint-{step}").mkdir(parents=True)
        (first / f"checkpoint-{step}" / "state.json").write_text(json.dumps({"step": step}))
    torn = tmp_path / "attempts" / "2" / "out" / "checkpoint-9"  # TRL's, killed while writing
    torn.mkdir(parents=True)
    (torn / "optimizer.pt").write_bytes(b"half")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    best = newest(tmp_path)
    assert best.step == 7 and best.path == (first / "checkpoint-7").resolve() and best.attempt == 1
    assert [c.step for c in checkpoints(tmp_path)] == list(range(1, 8))
    (torn / "trainer_state.json").write_text("{}")  # now complete: the newer one wins
    assert newest(tmp_path).step == 9
    assert all(p.read_bytes() == data for p, data in before.items())  # read, never written
