"""Any trainer by template: a space in the trainer's own names, the global-batch mapping, {max_steps},
format specs, and best/command.sh, which is run after the search to show that it works."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, one_line_error, run_cli

from autotune import configs
from autotune.candidate import constraints
from autotune.candidate.batch import completions_per_step
from autotune.candidate.space_file import load_space
from autotune.configs.command import fill, template_fields
from autotune.errors import UsageError
from autotune.export.command import command_files, command_sh
from autotune.hardware import GpuType
from autotune.models import resolve_model
from autotune.runners.base import TrialContext
from autotune.runners.command import CommandRunner
from autotune.study.record import TrialRow

DATA = ROOT / "tests" / "data" / "templates"
SPACE = DATA / "space.yaml"
TEMPLATE = (
    f"{sys.executable} {DATA / 'trainer.py'} --micro_train_batch_size {{micro_train_batch_size}} "
    "--grad_accum {grad_accum} --n_samples_per_prompt {n_samples_per_prompt} "
    "--train_batch_size {global_batch} --max_steps {max_steps} --run_name mb{micro_train_batch_size:03d} "
    "--output_dir {trial_dir}"
)
BASE = ["search", "--model", "Qwen2.5-0.5B", "--gpus", "2", "--gpu-type", "A100-80GB", "--trials", "1"]


def ran(folder: Path) -> dict:
    return json.loads((folder / "ran.json").read_text())


@pytest.mark.slow
def test_template_search_in_own_names_exports_a_command_sh_that_runs(tmp_path):
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "2",
        "--gpu-type",
        "A100-80GB",
        "--space",
        SPACE,
        "--command",
        TEMPLATE,
        "--global-batch",
        "32",
        "--set",
        "n_samples_per_prompt=8",
        "--trials",
        "4",
        "--confirm",
        "1",
        "--name",
        "tpl",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    study = tmp_path / "runs" / "tpl"
    trials = sorted(p.parent for p in study.glob("trials/*/outcome.json"))
    seen = {}
    for trial in trials:
        outcome = json.loads((trial / "outcome.json").read_text())
        assert outcome["status"] == "ok", (trial, outcome)
        params = json.loads((trial / "params.json").read_text())
        # the trial's params are the space's own names only: no TRL name leaks in
        assert set(params) == {"micro_train_batch_size", "grad_accum", "n_samples_per_prompt"}, params
        # the accumulation was derived from --global-batch (the trainer itself refuses a mismatch)
        assert params["micro_train_batch_size"] * params["grad_accum"] * 2 == 32
        got = ran(trial)
        assert got["train_batch_size"] == 32 and got["world"] == 2
        assert got["run_name"] == f"mb{params['micro_train_batch_size']:03d}"  # {x:03d} works
        assert got["max_steps"] == 2 + 3 + 3 >= outcome["steps"]  # {max_steps}: warm-up + measured + extra
        # throughput from step times and the mapped batch: 32 completions per step
        step_time = params["grad_accum"] * (0.004 + 0.001 * params["micro_train_batch_size"])
        assert outcome["throughput"] == pytest.approx(32 / step_time, rel=0.01)
        seen[params["micro_train_batch_size"]] = outcome["throughput"]
    assert len(seen) >= 3
    best = json.loads((study / "best" / "params.json").read_text())
    assert best["micro_train_batch_size"] == max(seen)  # the fastest measured, by construction
    confirmed = next(study.glob("confirm/*/ran.json")).parent  # a confirmation needs more steps
    assert ran(confirmed)["max_steps"] == 11 == json.loads((confirmed / "outcome.json").read_text())["steps"]
    script = study / "best" / "command.sh"
    text = script.read_text()
    assert os.access(script, os.X_OK)
    assert f"--micro_train_batch_size {best['micro_train_batch_size']}" in text
    assert '--output_dir "${OUTPUT_DIR}"' in text and "SET THIS" in text

    # run it as a user would, from elsewhere: a short run, then the default length
    run = subprocess.run(
        ["bash", str(script)],
        cwd="/",
        env={**os.environ, "MAX_STEPS": "3", "OUTPUT_DIR": str(tmp_path / "prod")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    prod = ran(tmp_path / "prod")
    assert prod["max_steps"] == 3 and prod["train_batch_size"] == 32 and prod["world"] == 2
    assert (
        prod["micro_train_batch_size"] == best["micro_train_batch_size"]
        and prod["grad_accum"] == best["grad_accum"]
    )
    assert prod["run_name"] == f"mb{best['micro_train_batch_size']:03d}"
    again = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("MAX_STEPS", "OUTPUT_DIR")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert ran(study / "best" / "run")["max_steps"] == 11  # the confirmation's length: 2 warm-up + 3 x 3
    # a later export with another runner removes command.sh (autotune's own file), nothing else
    (study / "best" / "notes.txt").write_text("mine")
    recipe_path = study / "recipe.yaml"
    recipe_path.write_text(recipe_path.read_text().replace("runner: command", "runner: trl"))
    assert run_cli("export", "tpl", cwd=tmp_path).returncode == 0
    assert not script.exists() and (study / "best" / "notes.txt").exists()


@pytest.mark.slow
def test_template_search_without_global_batch_counts_the_mapped_batch(tmp_path):
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "2",
        "--gpu-type",
        "A100-80GB",
        "--space",
        SPACE,
        "--command",
        TEMPLATE,
        "--set",
        "n_samples_per_prompt=4",
        "--trials",
        "2",
        "--confirm",
        "0",
        "--name",
        "free",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    for trial in (tmp_path / "runs" / "free").glob("trials/*"):
        params, got = json.loads((trial / "params.json").read_text()), ran(trial)
        per_step = params["micro_train_batch_size"] * params["grad_accum"] * 2
        assert got["train_batch_size"] == per_step  # {global_batch}: the mapped product
        outcome = json.loads((trial / "outcome.json").read_text())
        assert outcome["status"] == "ok", outcome
        step_time = params["grad_accum"] * (0.004 + 0.001 * params["micro_train_batch_size"])
        assert outcome["throughput"] == pytest.approx(per_step / step_time, rel=0.01)


# --- fast checks of the pieces ------------------------------------------------------------------------


def context(recipe_factory, tmp_path, template, space=SPACE, **kw):
    recipe = recipe_factory(command=template, runner="command", space=str(space), gpus=2, **kw)
    return TrialContext(
        recipe=recipe,
        space=load_space(space),
        model=resolve_model("Qwen2.5-0.5B"),
        gpu=GpuType("A100-80GB", 79.3, 100.0, 1.0, 32),
    )


def test_prepare_fills_max_steps_specs_and_global_batch(recipe_factory, tmp_path):
    runner = CommandRunner(context(recipe_factory, tmp_path, TEMPLATE, global_batch=32))
    runner.check()
    params = constraints.derive(
        {"micro_train_batch_size": 4, "grad_accum": 1, "n_samples_per_prompt": 8},
        runner.recipe,
        runner.context.space,
    )
    spec = runner.prepare(params, tmp_path / "t", 0, steps_needed=7)
    argv = spec.argv
    assert argv[argv.index("--grad_accum") + 1] == "4"  # 32 / (4 x 2)
    assert argv[argv.index("--max_steps") + 1] == "7"
    assert argv[argv.index("--train_batch_size") + 1] == "32"
    assert argv[argv.index("--run_name") + 1] == "mb004"
    assert argv[argv.index("--output_dir") + 1] == str(tmp_path / "t")
    # accumulation is derived, never sampled; the micro-batch is searched
    assert runner.searched() == {"micro_train_batch_size", "n_samples_per_prompt"}


@pytest.mark.parametrize(
    "token,values,expect",
    [
        ("--x {a}", {"a": True}, "--x true"),
        ("--x={a:.2f}", {"a": 0.5}, "--x=0.50"),
        ("--x {a:>4}", {"a": "ab"}, "--x   ab"),
        ("run{a:03d}", {"a": 7}, "run007"),
        ("--lr {a}", {"a": 1e-06}, "--lr 1e-06"),
    ],
)
def test_format_specs_apply_to_the_value(token, values, expect):
    tokens, _ = template_fields(f"prog '{token}'")
    assert fill(tokens, values)[1] == expect


@pytest.mark.parametrize(
    "template,fragment",
    [
        ("prog {a!r}", "conversions are not supported"),
        ("prog {a:{b}}", "cannot hold another placeholder"),
        ("prog {a.b}", "is not a plain name"),
        ("prog {}", "is not a plain name"),
    ],
)
def test_template_shapes_refused(template, fragment):
    with pytest.raises(UsageError, match=fragment):
        template_fields(template)


def test_a_spec_that_cannot_write_a_value_is_refused_up_front(recipe_factory, tmp_path):
    bad = TEMPLATE.replace("{grad_accum}", "{grad_accum:.2z}")
    with pytest.raises(UsageError, match=r"\{grad_accum:.2z\} cannot write grad_accum=1"):
        CommandRunner(context(recipe_factory, tmp_path, bad, global_batch=32)).check()
    with pytest.raises(UsageError, match=r"\{trial_dir:03d\} cannot write trial_dir"):
        CommandRunner(context(recipe_factory, tmp_path, TEMPLATE + " --x {trial_dir:03d}")).check()


def test_command_sh_quotes_values_and_marks_trial_only_ones(recipe_factory, tmp_path):
    template = (
        f"{sys.executable} -c 'import sys; print(sys.argv[1:])' --name 'a b{{micro_train_batch_size}}' "
        "--out={trial_dir}/ckpt --steps {max_steps} --m {metrics_file}"
    )
    recipe = context(recipe_factory, tmp_path, template, global_batch=32, workdir=str(tmp_path)).recipe
    row = TrialRow(
        number=3,
        status="ok",
        params={"micro_train_batch_size": 8, "grad_accum": 2, "n_samples_per_prompt": 8},
    )
    script = tmp_path / "command.sh"
    script.write_text(command_sh(row.params, recipe, row))
    out = subprocess.run(
        ["bash", str(script), "--extra"],
        env={**os.environ, "OUTPUT_DIR": "/o d"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(
        ["--name", "a b8", "--out=/o d/ckpt", "--steps", "11", "--m", "/o d/metrics.jsonl", "--extra"]
    )


def test_command_files_ship_the_deepspeed_json_the_trials_used(recipe_factory, tmp_path):
    space = tmp_path / "ds.yaml"
    space.write_text(
        "parameters:\n  zero_stage: {type: int, choices: [0, 2], default: 2}\n"
        "  offload: {type: categorical, choices: [none, optimizer], default: optimizer}\n"
    )
    recipe = recipe_factory(command="trainer --ds {deepspeed_config}", runner="command", space=str(space))
    row = TrialRow(number=0, status="ok", params={"zero_stage": 2, "offload": "optimizer"})
    files = command_files(row.params, recipe, row, {})
    assert (
        '--ds "${DS_CONFIG}"' in files["command.sh"][0]
        and 'DS_CONFIG="$HERE/ds_config.json"' in files["command.sh"][0]
    )
    shipped = json.loads(files["ds_config.json"][0])
    assert (
        shipped == configs.deepspeed_config(row.params, recipe) and shipped["zero_optimization"]["stage"] == 2
    )
    assert command_files(row.params, recipe, row, {"ds_config.json": ("{}", False)}).keys() == {"command.sh"}
    assert command_files(row.params, recipe_factory(runner="trl"), row, {}) == {}


# --- the global-batch mapping -------------------------------------------------------------------------


def space_file(tmp_path, block="", params=None):
    params = params or {"micro_train_batch_size": [1, 2, 4], "accum": [1, 2], "num_generations": [4, 8, 16]}
    text = "version: 1\n" + block + "parameters:\n"
    for name, choices in params.items():
        text += f"  {name}:\n    type: int\n    choices: {choices}\n    default: {choices[0]}\n"
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return load_space(path)


def test_mapping_derives_the_accumulation_and_drops_trl_placeholders(recipe_factory, tmp_path):
    space = space_file(tmp_path, "global_batch: {micro_batch: micro_train_batch_size, accumulation: accum}\n")
    recipe = recipe_factory(gpus=4, global_batch=64)
    out = constraints.derive(
        {"micro_train_batch_size": 4, "accum": 1, "num_generations": 8, "gradient_accumulation_steps": 0},
        recipe,
        space,
    )
    assert out == {"micro_train_batch_size": 4, "accum": 4, "num_generations": 8}
    assert completions_per_step(out, recipe, space.batch) == 64
    assert constraints.violations(out, recipe, space=space) == []
    bad = constraints.derive(
        {**out, "micro_train_batch_size": 32}, recipe_factory(gpus=3, global_batch=64), space
    )
    assert constraints.violations(bad, recipe_factory(gpus=3, global_batch=64), space=space) == [
        "global batch 64 is not divisible by micro_train_batch_size 32 x 3 data-parallel GPUs"
    ]
    # TRL's num_generations is the group size of a declared mapping too: 1 GPU, 1 x 1 = 1 per step
    one = recipe_factory(gpus=1)
    broken = constraints.violations(
        {"micro_train_batch_size": 1, "accum": 1, "num_generations": 4}, one, space=space
    )
    assert broken and "not divisible by num_generations 4" in broken[0]
    # the pins check enumerates the mapped names: only micro-batches that divide are left
    valid, _ = constraints.valid_combinations(space, recipe_factory(gpus=1, global_batch=4), {"accum": 1})
    assert sorted({v["micro_train_batch_size"] for v in valid}) == [1, 2, 4]


def test_per_all_and_a_trainer_that_derives_accumulation_itself(recipe_factory, tmp_path):
    space = space_file(
        tmp_path, "global_batch: {micro_batch: rollout_batch, per: all}\n", {"rollout_batch": [8, 16, 32]}
    )
    recipe = recipe_factory(gpus=4, global_batch=48)
    assert space.batch.accumulation is None
    assert completions_per_step({"rollout_batch": 16}, recipe, space.batch) == 48
    assert constraints.violations({"rollout_batch": 16}, recipe, space=space) == []
    assert (
        "not divisible by rollout_batch 32 x all GPUs together"
        in constraints.violations({"rollout_batch": 32}, recipe, space=space)[0]
    )
    assert completions_per_step({"rollout_batch": 16}, recipe_factory(gpus=4), space.batch) == 16


def test_trl_rules_apply_only_to_trl_names(recipe_factory, tmp_path):
    space = space_file(tmp_path)  # own names, no mapping declared
    assert space.batch is None
    one = recipe_factory(gpus=1)
    # TRL would see batch 8 x 1 and refuse num_generations 16; this trainer's batch is not TRL's
    assert (
        constraints.violations(
            {"micro_train_batch_size": 1, "accum": 1, "num_generations": 16}, one, space=space
        )
        == []
    )
    assert (
        "at least 2"
        in constraints.violations({"micro_train_batch_size": 1, "num_generations": 1}, one, space=space)[0]
    )
    assert completions_per_step({"micro_train_batch_size": 2}, one) is None  # unknown, not a KeyError
    assert completions_per_step({"micro_train_batch_size": 2}, recipe_factory(global_batch=64)) == 64
    # seeds put TRL's names beside the candidate; a space without them gets them dropped
    assert constraints.derive(
        {"micro_train_batch_size": 1, "gradient_accumulation_steps": None}, one, space
    ) == {"micro_train_batch_size": 1}
    with pytest.raises(UsageError, match="declare them at its top level, e.g. 'global_batch: {micro_batch"):
        constraints.check_pins_leave_candidates(space, recipe_factory(global_batch=64), {})


def test_the_shipped_trl_space_is_judged_as_before(recipe_factory):
    space = load_space()
    assert space.batch is not None and not space.batch.declared
    recipe = recipe_factory(global_batch=256)
    params = constraints.derive({**space.defaults(), "per_device_train_batch_size": 8}, recipe)
    assert params["gradient_accumulation_steps"] == 8 and completions_per_step(params, recipe) == 256


# --- bad input through the real CLI: one line, exit 2 ----------------------------------------------


@pytest.mark.parametrize(
    "extra,fragments",
    [
        (
            ["--command", TEMPLATE.replace("{grad_accum}", "{accumulation}")],
            (
                "placeholder {accumulation} names nothing",
                "micro_train_batch_size, grad_accum, n_samples_per_prompt",
            ),
        ),
        (
            ["--command", TEMPLATE.replace("{n_samples_per_prompt}", "{n_samples_per_prompt:s}")],
            ("{n_samples_per_prompt:s} cannot write", "fix the format spec"),
        ),
        (["--command", TEMPLATE.replace("{max_steps}", "{max_steps!s}")], ("conversions are not supported",)),
        (
            [
                "--command",
                TEMPLATE.replace(" --train_batch_size {global_batch}", "").replace("{grad_accum}", "4"),
            ],
            ("--global-batch 32: the template passes neither {global_batch} nor {grad_accum}",),
        ),
    ],
)
def test_bad_templates(tmp_path, extra, fragments):
    one_line_error(run_cli(*BASE, "--space", SPACE, "--global-batch", "32", *extra, cwd=tmp_path), *fragments)


def test_global_batch_without_a_mapping(tmp_path):
    space = tmp_path / "space.yaml"
    kept = [
        line
        for line in SPACE.read_text().splitlines()
        if not line.startswith(("global_batch", "  micro_batch", "  accumulation", "  generations"))
    ]
    space.write_text("\n".join(kept) + "\n")
    one_line_error(
        run_cli(*BASE, "--space", space, "--global-batch", "32", "--command", TEMPLATE, cwd=tmp_path),
        "--global-batch 32",
        "declare them",
        "global_batch: {micro_batch: NAME",
        "micro_train_batch_size",
    )


@pytest.mark.parametrize(
    "block,fragments",
    [
        (
            "global_batch: {micro_batch: micro, accumulation: grad_accum}\n",
            (":2:", "global_batch.micro_batch is 'micro'", "micro_train_batch_size"),
        ),
        (
            "global_batch:\n  micro_batch: micro_train_batch_size\n  per: node\n",
            (":4:", "global_batch.per is 'node'", "gpu"),
        ),
        (
            "global_batch:\n  micro_batch: micro_train_batch_size\n  accumulate: grad_accum\n",
            (":4:", "unknown key 'accumulate'", "accumulation"),
        ),
        (
            "global_batch: {accumulation: grad_accum}\n",
            (
                ":2:",
                "needs 'micro_batch'",
            ),
        ),
        (
            "global_batch: {micro_batch: grad_accum, accumulation: grad_accum}\n",
            (":2:", "different parameters"),
        ),
    ],
)
def test_broken_mapping_names_file_and_line(tmp_path, block, fragments):
    space = tmp_path / "space.yaml"
    body = SPACE.read_text().split("parameters:", 1)[1]
    space.write_text("version: 1\n" + block + "parameters:" + body)
    one_line_error(
        run_cli(*BASE, "--space", space, "--command", TEMPLATE, cwd=tmp_path), str(space), *fragments
    )


@pytest.mark.slow
def test_a_trainer_that_never_says_its_batch_is_told_what_to_declare(tmp_path):
    """Step times but no sample count, and a space with no global_batch: block: the throughput
    cannot be known, and the crash line must say what fixes it rather than quote the trainer."""
    (tmp_path / "space.yaml").write_text(
        "version: 1\nparameters:\n  x:\n    type: int\n    choices: [1, 2]\n    default: 1\n"
    )
    (tmp_path / "trainer.py").write_text(
        "import sys\nsteps = int(sys.argv[sys.argv.index('--max_steps') + 1])\n"
        "for step in range(steps):\n    print({'loss': 0.1, 'step_time': 0.01}, flush=True)\n"
        "print('training finished', flush=True)\n"
    )
    template = f"{sys.executable} {tmp_path / 'trainer.py'} --x {{x}} --max_steps {{max_steps}}"
    res = run_cli(
        "search",
        "--model",
        "Qwen2.5-0.5B",
        "--gpus",
        "1",
        "--gpu-type",
        "A100-80GB",
        "--space",
        str(tmp_path / "space.yaml"),
        "--command",
        template,
        "--trials",
        "1",
        "--confirm",
        "0",
        "--name",
        "nobatch",
        cwd=tmp_path,
    )
    outcome = json.loads((tmp_path / "runs" / "nobatch" / "trials" / "0" / "outcome.json").read_text())
    assert outcome["status"] == "crash", (outcome, res.stderr)
    assert "global_batch" in outcome["error_line"] and "samples" in outcome["error_line"]


# --- moved from test_review_fixes.py: a rendezvous port per command trial -----------------------------------


def test_command_trials_get_master_port_in_env_and_placeholder(recipe_factory, tmp_path):
    from autotune.export.command import command_sh
    from autotune.runners.command import CommandRunner
    from autotune.study.record import TrialRow

    template = (
        f"{sys.executable} -c pass --nproc {{num_processes}} --master_port {{master_port}} --x {{beta}}"
    )
    recipe = recipe_factory(command=template, runner="command", gpus=2)
    runner = CommandRunner(
        TrialContext(
            recipe=recipe,
            space=load_space(),
            model=resolve_model(recipe.model),
            gpu=GpuType("A100-80GB", 79.3, 100.0, 1.0, 32),
        )
    )
    runner.check()  # {master_port} is a known placeholder
    specs = [runner.prepare({}, tmp_path / f"t{i}", i) for i in range(2)]
    ports = [spec.env["MASTER_PORT"] for spec in specs]
    assert ports[0] != ports[1] and all(p.isdigit() for p in ports)
    for spec, port in zip(specs, ports):
        assert spec.argv[spec.argv.index("--master_port") + 1] == port  # the same port in both
    # best/command.sh runs alone on its node: torch's default port
    script = command_sh({}, recipe, TrialRow(number=0, status="ok", params={}))
    assert "--master_port 29500" in script


def test_grpo_group_rule_is_grpo_only(recipe_factory, tmp_path):
    """A PPO space whose `generations:` mapping names n_samples_per_prompt [1, 2, 4] is accepted:
    one sample a prompt is PPO's most common setting; GRPO's at-least-2 stays on num_generations."""
    text = (
        SPACE.read_text().replace("choices: [4, 8]", "choices: [1, 2, 4]").replace("default: 4", "default: 1")
    )
    ppo = tmp_path / "ppo.yaml"
    ppo.write_text(text)
    space = load_space(ppo)
    recipe = recipe_factory(gpus=2, global_batch=32)
    cand = constraints.derive({"micro_train_batch_size": 2, "n_samples_per_prompt": 1}, recipe, space)
    assert constraints.violations(cand, recipe, space=space) == []
    valid, _ = constraints.valid_combinations(space, recipe, {"grad_accum": 0})
    assert {c["n_samples_per_prompt"] for c in valid} == {1, 2, 4}
    assert "at least 2" in constraints.violations({"num_generations": 1}, recipe)[0]  # TRL's GRPO


def test_a_placeholder_whose_parameter_requires_dropped_takes_the_spaces_default(recipe_factory, tmp_path):
    """A parameter that only matters when another is set (``requires``) is dropped from candidates
    where it does not; its placeholder had raised KeyError in the trial and in best/command.sh."""
    space = tmp_path / "req.yaml"
    space.write_text(
        "version: 1\nparameters:\n"
        "  checkpointing: {type: bool, choices: [true, false], default: true}\n"
        "  granularity: {type: categorical, choices: [selective, full], default: full,"
        " requires: {checkpointing: true}}\n"
    )
    template = (
        f"{sys.executable} -c 'import sys; print(sys.argv[1:])' ckpt={{checkpointing}} gran={{granularity}}"
    )
    ctx = context(recipe_factory, tmp_path, template, space=space, workdir=str(tmp_path))
    runner = CommandRunner(ctx)
    runner.check()
    off = ctx.space.normalize({"checkpointing": False, "granularity": "selective"})
    assert off == {"checkpointing": False}  # dropped: it does not matter here
    assert runner.prepare(off, tmp_path / "t", 0).argv[-2:] == ["ckpt=false", "gran=full"]
    on = ctx.space.normalize({"checkpointing": True, "granularity": "selective"})
    assert runner.prepare(on, tmp_path / "t", 1).argv[-2:] == ["ckpt=true", "gran=selective"]
    script = tmp_path / "command.sh"
    script.write_text(command_sh(off, ctx.recipe, TrialRow(number=0, status="ok", params=off)))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["ckpt=false", "gran=full"])
