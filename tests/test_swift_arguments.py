"""The swift runner's validity rules agree with ms-swift's own argument checks.

autotune's rules for ms-swift (candidate/constraints.py and SwiftRunner.rules) were written from its
documentation; here ms-swift itself judges. For a sample of candidates from swift spaces (the batch,
the group size, steps_per_generation and/or generation_batch_size, vLLM on or off, sleep levels, ms-swift's offload knobs), the
command line the runner would launch is given to ms-swift's real ``RLHFArguments`` in its own
environment (tests/data/swift_accepts.py: ``__post_init__`` and the GRPO training arguments it
builds, what ``swift rlhf`` checks before loading a model). No candidate autotune would launch may
be refused, none it refuses may be accepted, and what was launched is what ms-swift keeps (4.6
silently sets sleep_level to 0 without vLLM: a trial recorded with a level that never ran would
teach the planner a falsehood).

Left out on purpose: ``vllm_mode=server`` (ms-swift accepts it with a server host; the runner refuses
it because it starts no rollout server), tensor-parallel sizes and ZeRO (what the machine and
ms-swift's environment can run, checked by SwiftRunner.forced, not by ms-swift's arguments).
"""

import json
import random
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, swift_program

from autotune import configs as lc
from autotune.candidate import constraints
from autotune.candidate.space_file import load_space
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.runners.base import TrialContext
from autotune.runners.swift import SwiftRunner

JUDGE = ROOT / "tests" / "data" / "swift_accepts.py"
VLLM = {
    "use_vllm": {"type": "bool", "choices": [True, False], "default": True},
    "vllm_mode": {"type": "categorical", "choices": ["colocate"], "default": "colocate", "requires": {"use_vllm": True}},
    "vllm_gpu_memory_utilization": {"type": "float", "low": 0.3, "high": 0.5, "step": 0.1, "default": 0.4,
                                    "requires": {"use_vllm": True, "vllm_mode": "colocate"}},
    "sleep_level": {"type": "int", "choices": [0, 1, 2], "default": 0,
                    "requires": {"use_vllm": True, "vllm_mode": "colocate"}},
    "offload_model": {"type": "bool", "choices": [False, True], "default": False,
                      "requires": {"use_vllm": True, "vllm_mode": "colocate"}},
    "move_model_batches": {"type": "int", "choices": [0, 2], "default": 0, "requires": {"use_vllm": True}},
}  # fmt: skip
BATCH = {
    "per_device_train_batch_size": {"type": "int", "choices": [1, 2, 3, 4], "default": 2},
    "gradient_accumulation_steps": {"type": "int", "choices": [1, 2, 3], "default": 1},
    "num_generations": {"type": "int", "choices": [1, 2, 3, 4, 8], "default": 2},
    "gradient_checkpointing": {"type": "bool", "choices": [True, False], "default": True},
}
SPACES = {
    "accumulation": {**BATCH, **VLLM},
    "steps_per_generation": {**BATCH, "steps_per_generation": {"type": "int", "choices": [1, 2, 4], "default": 1}},
    "generation_batch_size": {**BATCH, "generation_batch_size": {"type": "int", "choices": [4, 6, 8, 12], "default": 4}},
    "both": {**BATCH, "steps_per_generation": {"type": "int", "choices": [1, 2], "default": 1},
             "generation_batch_size": {"type": "int", "choices": [4, 8], "default": 4}},
}  # fmt: skip
SAMPLE = 24  # candidates per space (each costs ms-swift a parse; the grid is larger)


def runner_for(space_path: Path, program: Path) -> SwiftRunner:
    """The swift runner of a one-GPU CUDA study (vLLM's rules apply), on the installed ms-swift."""
    recipe = Recipe(
        model="tiny-qwen", gpus=1, gpu_type="H100-80GB", gpu_memory_gib=79.2, runner="swift",
        max_prompt_length=32, max_completion_length=16, space=str(space_path), swift_bin=str(program),
    )  # fmt: skip
    return SwiftRunner(
        TrialContext(recipe=recipe, space=load_space(space_path), model=resolve_model("tiny-qwen"), gpu=None)
    )


def launched_argv(runner: SwiftRunner, params: dict, folder: Path) -> list[str]:
    """What follows ``swift rlhf`` in the trial the runner would launch."""
    argv = runner.prepare(params, folder, 0, 4).argv
    argv = argv[argv.index("rlhf") + 1 :]
    # a CUDA study trains in bf16, which transformers refuses on a machine without a GPU: a check
    # of this machine, not of the candidate, so ms-swift judges the rest in float32
    argv[argv.index("--torch_dtype") + 1] = "float32"
    return argv


@pytest.mark.slow  # ms-swift parses about a hundred command lines
def test_the_swift_runner_launches_exactly_what_ms_swift_accepts(tmp_path):
    program = swift_program()
    cases: list[tuple[str, dict, list[str], list[str]]] = []  # space, candidate, autotune's refusals, argv
    for name, parameters in SPACES.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "parameters": parameters}))
        runner = runner_for(path, program)
        runner.check()
        space = runner.context.space
        grid = {json.dumps(space.normalize(c), sort_keys=True): space.normalize(c) for c in space.grid({})}
        for i, cand in enumerate(random.Random(name).sample(sorted(grid.values(), key=str), SAMPLE)):
            refused = constraints.violations(cand, runner.recipe, runner.rules(), space)
            cases.append((name, cand, refused, launched_argv(runner, cand, tmp_path / name / str(i))))
    done = subprocess.run(
        [str(Path(runner.python)), str(JUDGE)],
        input=json.dumps([argv for *_, argv in cases]),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(verdicts) == len(cases), done.stderr[-3000:]
    disagree = []
    for (name, cand, refused, _), verdict in zip(cases, verdicts):
        if verdict["ok"] == bool(refused):
            said = refused[0] if refused else verdict["error"]
            disagree.append(f"{name} {cand}: autotune {'refuses' if refused else 'launches'} ({said[:160]})")
        elif verdict["ok"] and cand.get("use_vllm"):
            assert verdict["sleep_level"] == lc.swift.sleep_level(cand), (cand, verdict)
    assert not disagree, "\n".join(disagree)
    # the sample means something: every space had candidates of both kinds, and ms-swift's own
    # reasons (not only autotune's) decided some of them
    for name in SPACES:
        kinds = {bool(refused) for n, _, refused, _ in cases if n == name}
        assert kinds == {True, False}, name
    errors = " ".join(v.get("error", "") for v in verdicts)
    assert "must be evenly divisible by num_generations" in errors
    assert "num_generations must be greater than 1" in errors
    assert "must be divisible by the global batch size" in errors


def test_ms_swift_splits_its_weight_sync_by_move_model_batches():
    """The memory direction autotune gives ``move_model_batches`` (search/knobs.py: more batches, no
    more memory) is ms-swift's: its rollout mixin syncs the weights to vLLM in that many groups of
    layers, and in one group when the argument is unset (what the space's 0 launches)."""
    venv = swift_program().resolve().parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/swift/rlhf_trainers/rollout_mixin.py"))
    assert found, f"no swift/rlhf_trainers/rollout_mixin.py under {venv}"
    source = found[0].read_text()
    assert re.search(r"if args\.move_model_batches is None:\s*\n\s*return \[\[", source)
    assert re.search(r"ceil\(layer_count / args\.move_model_batches\)", source)

    from autotune.search.knobs import KnobMemory

    knobs = KnobMemory.of(load_space(ROOT / "autotune" / "spaces" / "swift.yaml"))
    assert knobs.direction("move_model_batches", {"use_vllm": True}) == "down"
