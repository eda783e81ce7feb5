"""The ms-swift runner: flag names per ms-swift version, the export as the measured command minus the
trial-only flags, the bad-input lines. The real ms-swift search on CPU (a real out-of-memory under
``--memory-limit``, then ``best/swift.sh`` trained as written) is README's example, run as written by
``tests/test_readme.py``.
"""

import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import one_line_error, run_cli

from autotune import configs as lc
from autotune.candidate.space_file import load_space
from autotune.configs.swift import OLDEST, TRIAL_ONLY, SwiftVersion, TrialInputs
from autotune.errors import UsageError
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.runners.base import TrialContext


def recipe(**kw) -> Recipe:
    base = dict(
        model="Qwen2.5-7B-Instruct", gpus=4, gpu_type="A100-80GB", gpu_memory_gib=79.3, runner="swift"
    )
    base.update(kw)
    return Recipe(**base)


PARAMS = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "num_generations": 8,
    "zero_stage": 3,
    "offload": "none",
    "gradient_checkpointing": True,
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_gpu_memory_utilization": 0.45,
    "vllm_tensor_parallel_size": 1,
    "vllm_enable_sleep_mode": True,
}


def flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def inputs(**kw) -> TrialInputs:
    base = dict(
        program="/venv/bin/swift",
        model="/cache/tiny",
        model_type="qwen2",
        template="qwen",
        dataset="/t/prompts.jsonl",
        output_dir="/t/out",
        max_steps=9,
        truncate_left=True,
        ds_config_path="/t/ds_config.json",
    )
    base.update(kw)
    return TrialInputs(**base)


# --------------------------------------------------------------------------------------------
# flag names per version (boundaries read from the ms-swift source tags)


@pytest.mark.parametrize(
    "text,expect",
    [
        ("4.6.0", SwiftVersion(4, 6, 0)),
        ("3.12.6", SwiftVersion(3, 12, 6)),
        ("4.0.0.dev0", SwiftVersion(4, 0, 0)),
        ("3.1.1.post1", SwiftVersion(3, 1, 1)),
        ("v3.5", SwiftVersion(3, 5, 0)),
        ("unknown", None),
    ],
)
def test_version_parse(text, expect):
    assert SwiftVersion.parse(text) == expect


def test_flag_names_follow_the_version():
    r = recipe(lora_rank=8)
    v4 = flags(lc.swift_command(PARAMS, r, "m", version=SwiftVersion(4, 6, 0)))
    v3 = flags(lc.swift_command(PARAMS, r, "m", version=SwiftVersion(3, 12, 6)))
    old3 = flags(lc.swift_command(PARAMS, r, "m", version=SwiftVersion(3, 8, 0)))
    assert v4["--tuner_type"] == "lora" and "--train_type" not in v4
    assert v3["--train_type"] == "lora" and "--tuner_type" not in v3
    # TRL's sleep mode is vLLM level 2, which ms-swift reloads weights after only from 3.12.0
    assert v4["--sleep_level"] == "2" and v3["--sleep_level"] == "2" and old3["--sleep_level"] == "1"
    assert v4["--vllm_mode"] == "colocate" and v4["--deepspeed"] == "zero3"
    assert not SwiftVersion(3, 4, 1).supported and OLDEST == SwiftVersion(3, 5, 0) and OLDEST.supported


def test_swift_only_knobs_and_quantization():
    p = {
        **PARAMS,
        "sleep_level": 1,
        "offload_optimizer": True,
        "offload_model": False,
        "move_model_batches": 8,
        "deepspeed_config": "autotune",
    }
    f = flags(lc.swift_command(p, recipe(quantization="4bit", beta=0.04), "m", ds_config_path="/x/ds.json"))
    assert (
        f["--sleep_level"] == "1" and f["--offload_optimizer"] == "true" and f["--offload_model"] == "false"
    )
    assert f["--move_model_batches"] == "8" and f["--deepspeed"] == "/x/ds.json"  # autotune's JSON, not zero3
    assert f["--quant_method"] == "bnb" and f["--quant_bits"] == "4" and f["--bnb_4bit_quant_type"] == "nf4"
    assert f["--beta"] == "0.04"
    f8 = flags(lc.swift_command(PARAMS, recipe(quantization="8bit"), "m"))
    assert f8["--quant_bits"] == "8" and "--bnb_4bit_quant_type" not in f8


def test_export_is_the_trial_argv_minus_trial_only_flags():
    r = recipe(swift_args="--attn_impl sdpa --seed 7")
    trial = lc.swift_trial_argv(PARAMS, r, inputs(), SwiftVersion(4, 6, 0))
    f = flags(trial)
    assert (
        f["--max_steps"] == "9" and f["--dataset"] == "/t/prompts.jsonl" and f["--reward_funcs"] == "format"
    )
    assert trial.index("--attn_impl") < trial.index("--max_steps")  # the trial's own flags win
    prod = lc.production_argv(trial, model="Qwen/Qwen2.5-7B-Instruct", keep_template=False)
    removed = {"--dataset", "--reward_funcs", "--truncation_strategy", "--template"} | TRIAL_ONLY
    expect = ["swift", "rlhf"]
    i = 2
    while i < len(trial):
        if trial[i] in removed:
            i += 2
            continue
        expect += [trial[i], "Qwen/Qwen2.5-7B-Instruct" if trial[i] == "--model" else trial[i + 1]]
        i += 2
    assert prod == expect
    assert flags(prod)["--attn_impl"] == "sdpa" and flags(prod)["--model_type"] == "qwen2"
    kept = flags(lc.production_argv(trial, keep_dataset=True))
    assert (
        kept["--dataset"] == "/t/prompts.jsonl" and "--reward_funcs" not in kept and "--max_steps" not in kept
    )


def test_swift_sh_names_a_resolvable_model(tmp_path, monkeypatch):
    """A card with a hub id is named by it (no trial template); a test card by its materialised path."""
    from autotune.export.swift import swift_sh
    from autotune.study.record import TrialRow
    from autotune.worker.materialise import model_dir_for

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    best = TrialRow(3, dict(PARAMS), "ok", throughput=1.0)

    def argv_of(text: str) -> list[str]:
        line = next(ln for ln in text.replace("\\\n", " ").splitlines() if ln.startswith("exec "))
        return shlex.split(line)[1:]

    hub = flags(argv_of(swift_sh(PARAMS, recipe(beta=0.04), best)))
    assert hub["--model"] == "Qwen/Qwen2.5-7B-Instruct" and hub["--model_type"] == "qwen2"
    assert "--template" not in hub and hub["--beta"] == "0.04" and "--max_steps" not in hub
    tiny = resolve_model("tiny-qwen")
    cpu = recipe(model="tiny-qwen", gpus=1, device="cpu")
    p = {**PARAMS, "use_vllm": False, "zero_stage": 0}
    local = flags(argv_of(swift_sh(p, cpu, best)))
    assert local["--model"] == str(model_dir_for(tiny.name, tiny.config, "cpu"))
    assert local["--template"] == "qwen" and local["--torch_dtype"] == "float32"


# --------------------------------------------------------------------------------------------
# bad input: one line, exit 2


CPU_SEARCH = [
    "search",
    "--model",
    "tiny-qwen",
    "--gpus",
    "1",
    "--device",
    "cpu",
    "--runner",
    "swift",
    "--trials",
    "1",
]


def test_no_swift_says_how_to_install(tmp_path):
    env = {
        "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
        "AUTOTUNE_SWIFT_VENV": str(tmp_path / "none"),
    }
    one_line_error(
        run_cli(*CPU_SEARCH, cwd=tmp_path, env=env),
        "no swift program found",
        "bash scripts/swift_env.sh",
        "pip install ms-swift",
        "separate venv",
    )
    one_line_error(
        run_cli(*CPU_SEARCH, "--swift-bin", tmp_path / "nope" / "swift", cwd=tmp_path, env=env),
        "--swift-bin",
        "bash scripts/swift_env.sh",
    )


def test_unsplittable_swift_args(tmp_path):
    one_line_error(
        run_cli(*CPU_SEARCH, "--swift-args", "--system 'unclosed", cwd=tmp_path),
        "--swift-args cannot be split like a shell line",
    )


def test_too_old_swift_names_the_version_needed(tmp_path):
    """A real interpreter whose installed distributions say ms-swift 3.4.1 (what importlib.metadata reads)."""
    venv = tmp_path / "old"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    info = site / "ms_swift-3.4.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ms-swift\nVersion: 3.4.1\n")
    swift = venv / "bin" / "swift"
    swift.write_text(f"#!{venv / 'bin' / 'python'}\nraise SystemExit('not the real swift')\n")
    swift.chmod(0o755)
    one_line_error(
        run_cli(*CPU_SEARCH, "--swift-bin", swift, cwd=tmp_path), "ms-swift 3.4.1", "too old", ">= 3.5.0"
    )


def test_rules_refuse_what_this_version_cannot_run():
    from autotune.candidate.space_file import load_space
    from autotune.runners.base import TrialContext
    from autotune.runners.swift import SwiftRunner

    ctx = TrialContext(
        recipe=recipe(),
        space=load_space(lc.swift_space_path()),
        model=resolve_model("Qwen2.5-7B-Instruct"),
        gpu=None,
    )
    runner = SwiftRunner(ctx)
    runner.version = SwiftVersion(3, 11, 0)
    reasons = [rule({**PARAMS, "sleep_level": 2}) for rule in runner.rules()]
    assert any(r and "sleep_level=2 needs ms-swift >= 3.12.0" in r for r in reasons)
    runner.version = SwiftVersion(4, 6, 0)
    assert not any(rule({**PARAMS, "sleep_level": 2}) for rule in runner.rules())
    assert any(rule({**PARAMS, "zero_stage": 0, "deepspeed_config": "autotune"}) for rule in runner.rules())


def test_shipped_space_loads():
    from autotune.candidate.space_file import load_space

    space = load_space(lc.swift_space_path())
    assert {
        "sleep_level",
        "offload_optimizer",
        "offload_model",
        "move_model_batches",
        "deepspeed_config",
    } <= set(space.params)
    assert set(lc.SWIFT_ONLY) <= set(space.params)


# --- moved from test_review_fixes.py: ports of its own, one model build, no image tokens --------------------


SWIFT_PARAMS = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "num_generations": 8,
    "zero_stage": 3,
    "offload": "none",
    "gradient_checkpointing": True,
    "use_vllm": False,
}


def swift_runner(**kw):
    from autotune.configs.swift import SwiftVersion
    from autotune.runners.swift import SwiftRunner

    recipe = Recipe(
        **{
            **dict(
                model="Qwen2.5-7B-Instruct", gpus=2, gpu_type="A100-80GB", gpu_memory_gib=79.3, runner="swift"
            ),
            **kw,
        }
    )
    runner = SwiftRunner(
        TrialContext(
            recipe=recipe,
            space=load_space(lc.swift_space_path()),
            model=resolve_model(recipe.model),
            gpu=None,
        )
    )
    # what check() finds on a machine with ms-swift; no swift is run by these tests
    runner.program, runner.python, runner.version = (
        Path("/usr/bin/swift"),
        sys.executable,
        SwiftVersion(4, 6, 0),
    )
    return runner


def test_parallel_multi_gpu_swift_trials_rendezvous_on_ports_of_their_own(tmp_path, monkeypatch):
    from autotune.configs.swift_model import swift_model

    runner = swift_runner()
    plan = swift_model(runner.context.model, runner.recipe)
    monkeypatch.setattr(runner, "model_dir", lambda: (plan, str(tmp_path / "model")))
    monkeypatch.setattr(runner, "prompts", lambda *a: str(tmp_path / "prompts.jsonl"))
    specs = [runner.prepare(SWIFT_PARAMS, tmp_path / f"t{i}", i) for i in range(2)]
    ports = [spec.env.get("MASTER_PORT") for spec in specs]
    assert all(spec.env["NPROC_PER_NODE"] == "2" for spec in specs)
    assert all(p and p.isdigit() and p != "29500" for p in ports), ports
    assert ports[0] != ports[1]


def test_slot_threads_materialise_the_model_one_at_a_time(tmp_path, monkeypatch):
    """Each slot thread has its own runner; before the lock all of them saw no done marker and
    wrote the multi-GB model folder at once."""
    import autotune.worker.materialise as materialise

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    inside, most, builds = [0], [0], []
    guard = threading.Lock()

    def fake_run_with(python, args, **kw):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / materialise.DONE_FILE).write_text("{}")
        builds.append(out)
        with guard:
            inside[0] -= 1
        return str(out)

    monkeypatch.setattr(materialise, "run_with", fake_run_with)
    runners = [swift_runner(model="tiny-qwen") for _ in range(3)]
    found: list[str] = []
    threads = [threading.Thread(target=lambda r=r: found.append(r.model_dir()[1])) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 3 and len(set(found)) == 1
    assert most[0] == 1 and len(builds) == 1, (most, builds)


def test_swift_runner_refuses_image_tokens_in_one_line():
    with pytest.raises(UsageError, match="swift runner runs text-only trials"):
        swift_runner(model="Qwen2.5-VL-3B-Instruct", image_tokens=256).check_inputs()
    swift_runner(model="Qwen2.5-VL-3B-Instruct").check_inputs()  # text prompts on a VL model: fine


def test_both_generation_knobs_are_refused_for_trl_and_taken_by_ms_swift_when_they_agree(recipe_factory):
    """TRL's GRPOConfig refuses steps_per_generation with generation_batch_size; ms-swift 4.6's
    (tests/test_swift_arguments.py asks it) takes both when batch x GPUs x steps equals the size."""
    from autotune.candidate import constraints

    both = {"per_device_train_batch_size": 4, "num_generations": 4, "steps_per_generation": 2}
    trl = recipe_factory(gpus=1)
    swift = recipe_factory(gpus=1, runner="swift")
    assert "cannot both be set" in constraints.violations({**both, "generation_batch_size": 8}, trl)[0]
    assert constraints.violations({**both, "generation_batch_size": 8}, swift) == []
    (why,) = constraints.violations({**both, "generation_batch_size": 16}, swift)
    assert "must equal 4 per device x 1 GPUs x steps_per_generation 2" in why
