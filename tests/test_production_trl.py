"""`autotune run STUDY` with real TRL on CPU: a real search of tiny-qwen, a production run that saves
real TRL checkpoints, and a longer-completion run that dies of a real host OOM (RLIMIT_AS through
``--memory-limit``) and is resumed from its real TRL checkpoint on the smaller batch the study
measured, keeping the global batch. Slow (about two minutes on two idle cores).

Sizes (peak address space of the worker, TRL 1.16, prompt 32 tokens): batch 8 with 16-token
completions 2.6 GiB, batch 8 with 80-token completions 3.2 GiB, batch 4 x accumulation 2 with 80
tokens 2.8 GiB. Under a 2.95 GiB cap the trials (16 tokens) both run (batch 8 is usually the
faster, twice the completions per step at about the same step time; on a loaded machine the ranking
of two one-step trials is noise, so the test runs batch 8 whichever was exported), and only a run whose
completions grow to 80 tokens finds out that it does not fit.
"""

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

SPACE = {
    "version": 1,
    "parameters": {
        "per_device_train_batch_size": {"type": "int", "choices": [4, 8], "default": 8},
        "gradient_accumulation_steps": {"type": "int", "choices": [1], "default": 1},
        "num_generations": {"type": "int", "choices": [4], "default": 4},
        "zero_stage": {"type": "int", "choices": [0], "default": 0},
        "offload": {"type": "categorical", "choices": ["none"], "default": "none"},
        "gradient_checkpointing": {"type": "bool", "choices": [True], "default": True},
        "use_vllm": {"type": "bool", "choices": [False], "default": False},
    },
}
SEARCH = [
    "search", "--model", "tiny-qwen", "--gpus", "1", "--device", "cpu", "--memory-limit", "2.95",
    "--runner", "trl", "--max-prompt-length", "32", "--max-completion-length", "16",
    "--trials", "2", "--warmup-steps", "1", "--measure-steps", "1", "--confirm", "0", "--name", "trlrun",
]  # fmt: skip


def trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_real_trl_run_dies_of_host_oom_and_resumes_from_its_trl_checkpoint(tmp_path):
    import torch

    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    runs = tmp_path / "runs"
    res = run_cli(*SEARCH, "--space", space, "--runs-dir", runs, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    study = runs / "trlrun"
    batch_of = {
        json.loads((p / "params.json").read_text())["per_device_train_batch_size"]: int(p.name)
        for p in (study / "trials").iterdir()
    }
    assert sorted(batch_of) == [4, 8]
    # the configuration a long run will find too big, as best/params.json (what autotune run runs)
    exported = (study / "trials" / str(batch_of[8]) / "params.json").read_text()
    (study / "best" / "params.json").write_text(exported)

    # 1. the exported configuration as the production run: real TRL checkpoints, every step
    first = run_cli("run", "trlrun", "--runs-dir", runs, "--steps", "2", timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    attempt1 = study / "run" / "attempts" / "1"
    assert trainer_state(attempt1 / "checkpoint-2")["global_step"] == 2
    kept = {n: digest(attempt1 / f"checkpoint-{n}") for n in (1, 2)}

    # 2. completions grow to 80 tokens: batch 8 runs out of host memory in step 3 (a real
    # DefaultCPUAllocator failure); the run resumes from checkpoint-2 on batch 4 x 2 and finishes
    grown = run_cli(
        "run", "trlrun", "--runs-dir", runs, "--steps", "3", "--max-completion-length", "80", timeout=900
    )  # fmt: skip
    assert grown.returncode == 0, grown.stdout[-2000:] + grown.stderr[-3000:]
    attempt2, attempt3 = study / "run" / "attempts" / "2", study / "run" / "attempts" / "3"
    assert "DefaultCPUAllocator: can't allocate memory" in (attempt2 / "stderr.log").read_text()
    outcome = json.loads((attempt2 / "outcome.json").read_text())
    assert (outcome["status"], outcome["oom_kind"]) == ("oom", "host")
    trials = {p.name: (p / "outcome.json").read_text()[:400] for p in (study / "trials").iterdir()}
    # the study had measured the smaller batch (pruned or not: it ran without running out of memory)
    assert not (study / "run" / "probes").exists(), (trials, grown.stdout[-2000:])
    resumed = str((attempt1 / "checkpoint-2").resolve())
    assert (attempt3 / "resumed_from.txt").read_text().strip() == resumed
    state = trainer_state(attempt3 / "checkpoint-3")  # TRL's own record: it went on from step 2
    assert state["global_step"] == 3
    logged = [(h["step"], h["completions/mean_length"]) for h in state["log_history"] if "loss" in h]
    assert logged == [(1, 16.0), (2, 16.0), (3, 80.0)], logged
    args = torch.load(attempt3 / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)  # global 8 kept
    assert [json.loads(x)["step"] for x in (attempt3 / "metrics.jsonl").read_text().splitlines()] == [3]
    assert {n: digest(attempt1 / f"checkpoint-{n}") for n in (1, 2)} == kept  # never touched

    # 3. the study remembers: show (text and JSON), summary.md, report.html
    show = run_cli("show", "trlrun", "--runs-dir", runs).stdout
    line = next(x for x in show.splitlines() if x.startswith("production run incident 1"))
    assert "oom/host at step 3 of run attempt 2" in line and "DefaultCPUAllocator" in line, line
    assert "gradient_accumulation_steps=2, per_device_train_batch_size=4" in line, line
    assert f"(trial {batch_of[4]}, measured" in line and line.endswith(f"from {resumed}"), line
    print(line)
    rows = json.loads(run_cli("show", "trlrun", "--runs-dir", runs, "--json").stdout)
    by_number = {r["number"]: r for r in rows}
    (incident,) = by_number[batch_of[8]]["incidents"]
    assert incident["line"] == line and incident["step"] == 3 and incident["resumed_from"] == resumed
    assert by_number[batch_of[4]]["incidents"] == []
    summary = (study / "best" / "summary.md").read_text()
    assert "failed in a long run (oom/host at step 3, incident 1)" in summary
    assert json.loads((study / "best" / "params.json").read_text())["per_device_train_batch_size"] == 4
    report = run_cli("report", "trlrun", "--runs-dir", runs)
    assert report.returncode == 0, report.stderr
    assert "failed in a long run (oom/host at step 3, incident 1)" in (study / "report.html").read_text()
