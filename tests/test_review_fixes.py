"""Review findings: parallel multi-process trials' rendezvous ports, the shape-only and quantized
models built once (not per slot thread, rank or trial), inputs a runner would not measure, image
flags out of range, and the dashboard opening a PostgreSQL storage through the search's driver."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_bad_input import one_line_error

from autotune import configs as lc
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError
from autotune.hardware import GpuType
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.runners.base import TrialContext

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


# --- 4: every multi-process trial gets a rendezvous port of its own ------------------------------


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


# --- 9: parallel slot threads materialise the shape-only model once ----------------------------


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


# --- 8: a quantized shape-only base is written once, in the cache, not per trial ----------------


def test_quantized_base_is_cached_by_content_and_built_once(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import autotune.worker.model as wm

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    built = []
    real = wm._random_model

    def counting(*a, **k):
        built.append(1)
        time.sleep(0.2)  # the other threads arrive while the first builds
        return real(*a, **k)

    monkeypatch.setattr(wm, "_random_model", counting)
    tiny = resolve_model("tiny-qwen")
    info = {"name": tiny.name, "config": dict(tiny.config), "source": "card"}
    out: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda i=i: out.append(
                wm.write_weights_dir(info, tmp_path / f"trial{i}", "cpu", wm._model_dtype("cpu"))
            )
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 3 and len(set(out)) == 1 and len(built) == 1
    folder = out[0]
    assert folder.is_relative_to(tmp_path / "cache") and (folder / "config.json").is_file()
    assert any(folder.glob("*.safetensors"))
    assert not any((tmp_path / f"trial{i}").exists() for i in range(3))  # nothing per trial
    # another card (or dtype) is another entry
    other = wm.weights_dir_for({**info, "config": {**info["config"], "num_hidden_layers": 1}}, "cpu")
    assert other != folder and wm.weights_dir_for(info, "cuda") != folder


# --- 11: runners that would not carry image tokens refuse them ----------------------------------


def test_swift_runner_refuses_image_tokens_in_one_line():
    with pytest.raises(UsageError, match="swift runner runs text-only trials"):
        swift_runner(model="Qwen2.5-VL-3B-Instruct", image_tokens=256).check_inputs()
    swift_runner(model="Qwen2.5-VL-3B-Instruct").check_inputs()  # text prompts on a VL model: fine


def test_swift_and_sim_searches_with_image_tokens_are_one_line_errors(tmp_path):
    one_line_error(
        run_cli(
            "search",
            "--model",
            "tiny-qwen-vl",
            "--gpus",
            "1",
            "--device",
            "cpu",
            "--runner",
            "swift",
            "--image-tokens",
            "64",
            "--trials",
            "1",
            cwd=tmp_path,
        ),
        "text-only",
    )
    one_line_error(
        run_cli(
            "search",
            "--model",
            "Qwen2.5-VL-3B-Instruct",
            "--gpus",
            "1",
            "--gpu-type",
            "H100-80GB",
            "--runner",
            "sim",
            "--image-tokens",
            "256",
            "--trials",
            "1",
            cwd=tmp_path,
        ),
        "--runner sim",
        "text-only",
    )
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("study.db"))


# --- 12: image flags out of range ---------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--image-tokens", "-3000"], "--image-tokens -3000"),
        (["--image-tokens", "256", "--images-per-prompt", "-2"], "--images-per-prompt -2"),
        (["--image-tokens", "256", "--images-per-prompt", "0"], "--images-per-prompt 0"),
    ],
)
def test_negative_image_flags_are_refused(tmp_path, flags, needle):
    base = ["--model", "Qwen2.5-VL-3B-Instruct", "--gpus", "1", "--gpu-type", "H100-80GB"]
    one_line_error(run_cli("estimate", *base, *flags, cwd=tmp_path), needle)
    one_line_error(run_cli("search", *base, "--runner", "sim", "--trials", "1", *flags, cwd=tmp_path), needle)


# --- 13: the dashboard opens PostgreSQL through the search's driver, failing in one line --------


def test_dashboard_on_postgresql_with_psycopg3_only_is_one_line(tmp_path, monkeypatch):
    """``postgresql://`` went to SQLAlchemy's default psycopg2 (not installed next to psycopg 3):
    a ModuleNotFoundError traceback. Through driver_url it is psycopg 3, and a server that is not
    there is one line."""
    pytest.importorskip("optuna_dashboard")
    pytest.importorskip("psycopg")
    from autotune.study import dashboard, storage
    from autotune.study.paths import StudyPaths

    monkeypatch.setattr(storage, "importable", lambda name: name == "psycopg")
    monkeypatch.setattr(dashboard, "_check_address", lambda host, port: None)
    recipe = Recipe(model="tiny-qwen", gpus=1, storage="postgresql://user:secret@127.0.0.1:9/none")
    with pytest.raises(UsageError) as caught:
        dashboard.serve(StudyPaths(tmp_path, "s"), recipe, port=0)
    text = caught.value.format_message()
    assert len(text.splitlines()) == 1 and "secret" not in text, text
    assert "psycopg2" not in text, text
    monkeypatch.setattr(storage, "importable", lambda name: False)
    with pytest.raises(UsageError, match="needs a PostgreSQL driver"):
        dashboard.serve(StudyPaths(tmp_path, "s"), recipe, port=0)
