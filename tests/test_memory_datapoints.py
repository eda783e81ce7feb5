"""docs/memory-model.md must be what the current memory model gives for the published datapoints."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "memory_datapoints.py"
DOC = ROOT / "docs" / "memory-model.md"


def _load():
    spec = importlib.util.spec_from_file_location("memory_datapoints", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_doc_is_current(tmp_path):
    mod = _load()
    out = tmp_path / "memory-model.md"
    mod.write(out)
    assert out.read_text() == DOC.read_text(), (
        "docs/memory-model.md is stale: run `.venv/bin/python scripts/memory_datapoints.py`"
    )


def test_headline_matches_the_model():
    mod = _load()
    result = mod.evaluate()
    text = DOC.read_text()
    assert result["n_peaks"] > 0 and result["n_verdicts"] > 0
    assert f"median absolute relative error **{mod._pct(result['median_abs_error'])}**" in text
    assert (f"the model's verdict agrees on **{result['verdicts_agree']} of {result['n_verdicts']}**") in text
    # one table row per predicted datapoint
    table_ids = re.findall(r"^\| ([\w.-]+) \| ", text, flags=re.M)
    assert table_ids[1:] == [r["dp"]["id"] for r in result["rows"]]


def test_datapoints_are_complete():
    mod = _load()
    ids = [dp["id"] for dp in mod.DATAPOINTS]
    assert len(ids) == len(set(ids))
    need = {
        "id",
        "source",
        "model",
        "gpus",
        "gpu",
        "prompt",
        "completion",
        "per_device_batch",
        "grad_accum",
        "num_generations",
        "zero_stage",
        "offload",
        "grad_ckpt",
        "vllm",
        "reported",
        "framework",
        "measured",
        "assumed",
    }
    for dp in mod.DATAPOINTS:
        assert need <= dp.keys(), (dp["id"], need - dp.keys())
        rep = dp["reported"]
        assert rep in ("oom", "fit") or (isinstance(rep, float) and rep > 0), dp["id"]
        assert dp["source"], dp["id"]
    for s in mod.SKIPPED:
        assert s["source"] and s["reason"]
