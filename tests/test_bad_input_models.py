"""Bad model input through the real CLI: one line naming the fix, exit 2, never a traceback.

A config autotune cannot count fully (an unknown vision tower, an unknown quantization format) is
refused up front rather than planned on with a part of its memory left out.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from autotune.models import resolve_model


def _dir(tmp_path, **extra):
    config = dict(resolve_model("Qwen2.5-3B").config, **extra)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            {"model_type": "llava_next", "vision_config": {"hidden_size": 1024}},
            "vision tower is not modelled",
        ),
        ({"model_type": "qwen2_5_vl", "vision_config": {"depth": 32}}, "vision_config has no 'hidden_size'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "--quantization 4bit|8bit"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, "add --lora-rank"),
    ],
)
def test_model_the_memory_model_cannot_count_is_one_line(tmp_path, extra, fragment):
    res = run_cli("estimate", "--model", _dir(tmp_path, **extra), "--gpus", "1", "--gpu-type", "A100-80GB")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in res.stderr, res.stderr
