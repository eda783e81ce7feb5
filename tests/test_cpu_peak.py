"""Peak memory of CPU trials whose trainer reports none, and headroom against --memory-limit.

A real trainer script (a subprocess through ``--command``, its memory really resident) prints
HF-style step dicts with ``step_time`` and no memory field, as ms-swift does on CPU. The trial's
peak is then the process tree's peak RSS, and with ``--memory-limit`` a configuration that peaked
within ``--headroom`` of the cap is not exported.
"""

import json
import sys
import textwrap

from conftest import run_cli

# each completion of the batch holds 160 MiB, really resident (written, not just reserved)
MIB_PER_COMPLETION = 160

TRAINER = textwrap.dedent(f"""
    import argparse, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--per_device_train_batch_size", type=int)
    a = p.parse_args()
    held = b"x" * ({MIB_PER_COMPLETION} * 2**20 * a.per_device_train_batch_size)
    for step in range(1, 12):
        time.sleep(0.2)
        # no memory(GiB), no peak_memory_gib: the trainer says nothing about memory
        print({{"loss": 0.1, "step_time": 0.5, "epoch": step / 100}}, flush=True)
""")

SPACE = textwrap.dedent("""
    version: 1
    parameters:
      per_device_train_batch_size: {type: int, choices: [2, 8], default: 2}
      gradient_accumulation_steps: {type: int, choices: [1], default: 1}
      num_generations: {type: int, choices: [2], default: 2}
""")


def search(tmp_path, name, *extra):
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "space.yaml").write_text(SPACE)
    template = f"{sys.executable} trainer.py --per_device_train_batch_size {{per_device_train_batch_size}}"
    res = run_cli(
        "search",
        "--model",
        "tiny-qwen",
        "--gpus",
        "1",
        "--device",
        "cpu",
        "--command",
        template,
        "--space",
        "space.yaml",
        "--trials",
        "2",
        "--confirm",
        "0",
        "--warmup-steps",
        "1",
        "--measure-steps",
        "2",
        "--name",
        name,
        *extra,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    study = tmp_path / "runs" / name
    by_batch = {}
    for f in study.glob("trials/*/outcome.json"):
        outcome = json.loads(f.read_text())
        if outcome.get("launched"):
            batch = json.loads((f.parent / "params.json").read_text())["per_device_train_batch_size"]
            by_batch[batch] = outcome
    return study, by_batch


def test_cpu_peak_is_the_trees_rss_and_headroom_is_judged_against_the_memory_limit(tmp_path):
    # a 1.6 GiB cap (RLIMIT_AS) with 25% headroom: 1.2 GiB may be used. Batch 8 holds 1.25 GiB and
    # runs under the cap, but inside the headroom
    study, by_batch = search(tmp_path, "capped", "--memory-limit", "1.6", "--headroom", "0.25")
    assert set(by_batch) == {2, 8}
    for batch, outcome in by_batch.items():
        assert outcome["status"] == "ok", outcome
        held = batch * MIB_PER_COMPLETION / 1024
        # the tree's peak RSS: what the script holds, plus an interpreter (well under 100 MiB)
        assert held < outcome["peak_memory_gib"] < held + 0.1, outcome
        assert outcome["extra"]["peak_source"] == "host_rss"
        assert outcome["extra"]["monitor"]["peak_process_rss_gib"] >= held
    # batch 8 is 4x faster but peaked above 1.2 GiB = 75% of the 1.6 GiB cap: batch 2 is exported
    assert by_batch[8]["throughput"] > 3 * by_batch[2]["throughput"]
    best = json.loads((study / "best" / "params.json").read_text())
    assert best["per_device_train_batch_size"] == 2
    summary = (study / "best" / "summary.md").read_text()
    assert "passed over" in summary and "1.6 GiB --memory-limit" in summary


def test_without_a_memory_limit_no_headroom_is_judged_on_cpu(tmp_path):
    study, by_batch = search(tmp_path, "free", "--headroom", "0.25")
    assert by_batch[8]["status"] == "ok" and by_batch[8]["peak_memory_gib"] > 1.25
    best = json.loads((study / "best" / "params.json").read_text())
    assert best["per_device_train_batch_size"] == 8
