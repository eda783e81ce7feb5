"""What best/ ships runs as it is: the checkpointing field the installed transformers expects, the
exact LoRA adapter the trials measured, models named so that TRL's script and ms-swift load them,
and a template study's best/ holding only what it measured."""

import warnings

import pytest

from autotune import configs as lc
from autotune.recipe import Recipe


def cpu_recipe(**kw) -> Recipe:
    base = dict(model="tiny-qwen", gpus=1, device="cpu", max_prompt_length=32, max_completion_length=16)
    base.update(kw)
    return Recipe(**base)


PARAMS = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_generations": 4,
    "zero_stage": 0,
    "offload": "none",
    "gradient_checkpointing": False,
    "use_vllm": False,
}


def test_exported_grpo_config_names_checkpointing_as_the_installed_transformers_does(tmp_path):
    """transformers 5.23 warns (FutureWarning) on gradient_checkpointing; the field it declares is
    written instead, and the value still reaches the config (TRL's default is True)."""
    import transformers
    import trl

    kwargs = lc.grpo_config_kwargs(PARAMS, cpu_recipe())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = trl.GRPOConfig(**kwargs, output_dir=str(tmp_path), report_to=[])
    assert config.gradient_checkpointing is False
    fields = set(transformers.TrainingArguments.__dataclass_fields__)
    expected = (
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    )
    assert lc.checkpointing_field() == expected and expected in kwargs


def shell_array(text: str, name: str) -> list[str]:
    import shlex

    line = next(ln for ln in text.splitlines() if ln.startswith(f"{name}=("))
    return shlex.split(line[len(name) + 2 : -1])


def swift_flags(text: str) -> dict[str, str]:
    import shlex

    line = next(ln for ln in text.replace("\\\n", " ").splitlines() if ln.startswith("exec "))
    argv = shlex.split(line)[1:]
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def write(tmp_path, recipe: Recipe, params: dict | None = None):
    from autotune.export.writer import write_best
    from autotune.study.record import TrialRow

    best = TrialRow(0, dict(params or PARAMS), "ok", throughput=2.0, peak_memory_gib=1.0)
    out = tmp_path / "best"
    write_best(out, best, recipe, [best])
    return out


def test_lora_exports_carry_the_adapter_the_trials_trained(tmp_path, monkeypatch):
    """TRL's own script, parsing launch.sh's model flags, builds the LoraConfig the worker built;
    swift.sh passes the same rank, alpha, target modules and dropout."""
    from trl import get_peft_config
    from trl.scripts.grpo import make_parser

    from autotune.worker.model import peft_config

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = write(tmp_path, cpu_recipe(model="Qwen2.5-0.5B-Instruct", lora_rank=8))
    args = shell_array((out / "launch.sh").read_text(), "MODEL_ARGS")
    _, _, model_args, _ = make_parser().parse_args_and_config(
        ["--config", str(out / "grpo_config.yaml"), *args, "--output_dir", str(tmp_path / "o")]
    )
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    theirs, ours = get_peft_config(model_args), peft_config({"lora_rank": 8})
    for field in ("r", "lora_alpha", "target_modules", "lora_dropout", "task_type"):
        assert getattr(theirs, field) == getattr(ours, field), field
    swift = swift_flags((out / "swift.sh").read_text())
    assert (swift["--lora_rank"], swift["--lora_alpha"], swift["--target_modules"]) == (
        "8",
        "16",
        "all-linear",
    )
    assert float(swift["--lora_dropout"]) == ours.lora_dropout


def test_swift_sh_of_a_sim_study_names_a_folder_that_loads_not_a_card_name(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = write(tmp_path, cpu_recipe(runner="sim"))
    model = swift_flags((out / "swift.sh").read_text())["--model"]
    assert model != "tiny-qwen" and (tmp_path / "cache") in __import__("pathlib").Path(model).parents
    assert {"config.json", "tokenizer.json"} <= {p.name for p in __import__("pathlib").Path(model).iterdir()}
    assert shell_array((out / "launch.sh").read_text(), "MODEL_ARGS")[1] == model


def test_a_template_study_exports_only_what_it_measured(tmp_path):
    recipe = cpu_recipe(runner="command", command="python train.py --bs {bs} --steps {max_steps}")
    out = write(tmp_path, recipe, {"bs": 4})
    assert sorted(p.name for p in out.iterdir()) == ["command.sh", "params.json", "summary.md"]
    summary = (out / "summary.md").read_text()
    reproduce = summary.split("## Reproduce", 1)[1].split("## Files", 1)[0]
    assert "command.sh" in reproduce and "launch.sh" not in reproduce and "swift.sh" not in reproduce


def train_with_launch_sh(tmp_path, out) -> str:
    """``bash best/launch.sh --dataset_name DATA --reward_funcs think_format_reward --max_steps 2
    --output_dir OUT`` as the README says, with a local .jsonl of chat prompts; its last line."""
    import json
    import os
    import subprocess

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Think first."}]} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        ["bash", str(out / "launch.sh"), "--dataset_name", str(data), "--reward_funcs", "think_format_reward",
         "--max_steps", "2", "--output_dir", str(tmp_path / "run"), "--report_to", "none"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "'train_runtime'" in done.stdout + done.stderr and "Training completed" in done.stdout
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_cpu_rehearsal_launch_sh_trains_with_only_a_dataset_and_a_reward(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = write(tmp_path, cpu_recipe())
    assert "Model saved to" in train_with_launch_sh(tmp_path, out)
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_qlora_export_trains_through_trls_script_with_the_measured_adapter(tmp_path, monkeypatch):
    import json

    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = write(tmp_path, cpu_recipe(lora_rank=8, quantization="4bit"))
    train_with_launch_sh(tmp_path, out)
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (8, 16, 0.0)
    # all-linear: every projection of the attention and the MLP, not q_proj/v_proj only
    assert {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
