"""What ms-swift's environment can run is asked of its own interpreter before a search: a venv
without DeepSpeed searches ZeRO 0 only (one log line), one without bitsandbytes refuses
--quantization in one line; scripts/swift_env.sh's venv has both."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_line_error, run_cli

from autotune.configs.swift import SwiftVersion
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.runners.swift_env import capabilities


def bare_swift(tmp_path: Path) -> Path:
    """A real interpreter whose distributions say ms-swift 4.6.0 and nothing else (no DeepSpeed,
    bitsandbytes or vLLM), with a swift script naming it, as an old swift_env.sh left it."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    info = site / "ms_swift-4.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ms-swift\nVersion: 4.6.0\n")
    swift = venv / "bin" / "swift"
    swift.write_text(f"#!{venv / 'bin' / 'python'}\nraise SystemExit('not the real swift')\n")
    swift.chmod(0o755)
    return swift


def test_a_venv_without_deepspeed_searches_zero_0_and_says_so(tmp_path, caplog):
    from autotune.candidate.space_file import load_space
    from autotune.configs.swift import swift_space_path
    from autotune.runners.base import TrialContext
    from autotune.runners.swift import SwiftRunner

    swift = bare_swift(tmp_path)
    recipe = Recipe(model="tiny-qwen", gpus=1, device="cpu", runner="swift", swift_bin=str(swift))
    ctx = TrialContext(
        recipe=recipe, space=load_space(swift_space_path()), model=resolve_model("tiny-qwen"), gpu=None
    )
    runner = SwiftRunner(ctx)
    runner.check()
    assert runner.version == SwiftVersion(4, 6, 0)
    with caplog.at_level(logging.WARNING):
        forced = runner.forced()
    assert forced == {"zero_stage": 0, "offload": "none", "use_vllm": False}
    lines = [r.getMessage() for r in caplog.records if "deepspeed" in r.getMessage()]
    assert len(lines) == 1 and "ZeRO stage 0 only" in lines[0] and "scripts/swift_env.sh" in lines[0]


def test_quantization_without_bitsandbytes_in_swift_venv_is_one_line(tmp_path):
    swift = bare_swift(tmp_path)
    res = run_cli(
        "search", "--model", "tiny-qwen", "--gpus", "1", "--device", "cpu", "--runner", "swift",
        "--swift-bin", swift, "--lora-rank", "8", "--quantization", "4bit", "--trials", "1", cwd=tmp_path,
    )  # fmt: skip
    one_line_error(res, "--quantization 4bit", "no bitsandbytes", "bash scripts/swift_env.sh")


def test_swift_env_script_venv_has_what_the_shipped_space_searches():
    """The venv scripts/swift_env.sh makes (CI runs it; AUTOTUNE_REQUIRE_SWIFT=1 there) carries
    DeepSpeed and bitsandbytes, so swift.yaml's ZeRO stages and --quantization can run."""
    venv = Path(os.environ.get("AUTOTUNE_SWIFT_VENV") or Path.home() / ".cache" / "autotune" / "swift-venv")
    python = venv / "bin" / "python"
    if not python.is_file():
        if os.environ.get("AUTOTUNE_REQUIRE_SWIFT") == "1":
            pytest.fail(
                f"AUTOTUNE_REQUIRE_SWIFT=1 but no ms-swift venv at {venv}: run bash scripts/swift_env.sh"
            )
        pytest.skip(f"no ms-swift venv at {venv} (bash scripts/swift_env.sh makes it)")
    have = capabilities(str(python))
    assert have["deepspeed"] and have["bitsandbytes"], have
