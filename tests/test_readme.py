"""Every shell command in README.md works as written: a README change that breaks one fails here.

The ```bash blocks are read from README.md itself. Every ``autotune`` command is parsed by the
real CLI (its subcommand and each flag and value, as click parses them, without running it); the
blocks meant for this machine (``--runner sim``, ``--device cpu``) run exactly as written, in a
fresh folder, slow. The GPU-only blocks stay at the parse level. README's install line
(``pip install -e ".[test]"``) made this environment and is not run again; ``python -m pytest`` is
this suite itself.
"""

import json
import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from conftest import swift_program

from autotune.configs import production_argv
from autotune.configs.swift import OLDEST, SwiftVersion

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent


def blocks() -> list[list[list[str]]]:
    """Each ```bash block of README.md as its commands (continuations joined, comments and
    ``&&`` chains split)."""
    found = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    out = []
    for text in found:
        commands: list[list[str]] = []
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            current: list[str] = []
            for word in words + ["&&"]:
                if word == "&&":
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(word)
        out.append(commands)
    return out


def runs_here(block: list[list[str]]) -> bool:
    """A block whose search runs on this machine: the simulator or CPU trials."""
    searches = [c for c in block if c[:2] == ["autotune", "search"]]
    return bool(searches) and all(
        "--device" in c and c[c.index("--device") + 1] == "cpu" or "sim" in c for c in searches
    )


ALL = blocks()
AUTOTUNE = [c for block in ALL for c in block if c[0] == "autotune"]
#: what runs on a study a search made, never searching itself (``autotune run STUDY`` in "Run it")
ON_A_STUDY = ("run", "show", "verify", "export", "report")


def follow_ups(index: int) -> list[list[str]]:
    """The commands of other blocks that only use a study block ``index`` makes (README's "Run it"
    after the CPU rehearsal): they run after it, in its folder, as written."""
    block = ALL[index]
    studies = {c[2] for c in block if c[:1] == ["autotune"] and len(c) > 2 and c[1] in ON_A_STUDY}
    out: list[list[str]] = []
    for other in ALL:
        if other is block or runs_here(other):
            continue
        if other and all(
            c[0] == "autotune" and c[1] in ON_A_STUDY and c[2:3] and c[2] in studies for c in other
        ):
            out.extend(other)
    return out


def test_readme_has_the_examples_this_test_runs():
    assert len(AUTOTUNE) >= 8 and sum(runs_here(b) for b in ALL) >= 3
    # each kind of block has its own checks below (the sim search's replace a search of its own in
    # test_search_e2e.py): a README without one of them would drop those checks silently
    runners = {runner_of(b) for b in ALL if runs_here(b)}
    assert runners == set(KEEPS_ITS_WORD), f"README's blocks that run here search with {runners}"
    installs = [c for b in ALL for c in b if is_install(c) and "install" in c]
    assert installs, "README's install line is gone"
    followed = [c for i, b in enumerate(ALL) if runs_here(b) for c in follow_ups(i)]
    assert any(c[1] == "run" for c in followed), "README's 'Run it' line no longer runs on a study it makes"


@pytest.mark.parametrize("argv", AUTOTUNE, ids=[" ".join(c[:3]) for c in AUTOTUNE])
def test_every_autotune_command_in_readme_parses(argv):
    """The subcommand exists and every flag and value parses (click's own parser and types)."""
    from autotune.cli import main

    assert argv[1] in main.commands, f"README names no such command: {argv[1]}"
    command = main.commands[argv[1]]
    try:
        command.make_context(argv[1], argv[2:])
    except click.UsageError as exc:
        pytest.fail(f"{shlex.join(argv)}: {exc.format_message()}")


def test_readme_searches_run_one_after_another_in_one_folder(monkeypatch):
    """A reader runs README's blocks in order in one folder: each search that runs here makes a
    study of its own (its --name, else the name autotune derives), or the second stops with "already
    exists with a different recipe" (the ms-swift block after the CPU rehearsal did)."""
    from autotune.cli import main, recipe_from_flags

    monkeypatch.chdir(ROOT)
    names = {}
    for block in ALL:
        if runs_here(block):
            search = next(c for c in block if c[:2] == ["autotune", "search"])
            params = main.commands["search"].make_context("search", search[2:]).params
            names[shlex.join(search)] = recipe_from_flags(dict(params)).name
    assert len(set(names.values())) == len(names), names


def is_install(argv: list[str]) -> bool:
    """README's install line: it made this environment (``.ci/run`` runs it in a fresh one)."""
    words = [w for w in argv if "=" not in w or w.startswith("-")]
    return words[:1] in (["pip"], ["."], ["source"]) or words[:3] == ["python3", "-m", "venv"]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if argv[0] == "autotune":
        argv = [sys.executable, "-m", "autotune", *argv[1:]]
    elif argv[:2] == ["bash", "scripts/swift_env.sh"]:
        argv = ["bash", str(ROOT / argv[1])]
    for i, word in enumerate(argv):  # README's relative paths are the repository's
        if word.startswith("search_spaces/"):
            argv[i] = str(ROOT / word)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=3000)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a block is several real trainings: 10 min idle, 3 times that under load
@pytest.mark.parametrize("index", [i for i, b in enumerate(ALL) if runs_here(b)])
def test_readme_blocks_meant_for_this_machine_run_as_written(index, tmp_path):
    """The sim search, the CPU rehearsal with its verify (then "Run it" on the study it made), the
    ms-swift example: each command as written, in order, in one fresh folder; each search exports
    best/ (launch.sh, swift.sh), and a block does what README's text around it says it does."""
    outputs: dict[str, str] = {}
    for argv in ALL[index] + follow_ups(index):
        if is_install(argv):
            continue
        if argv[0] == "bash" and not (ROOT / "scripts" / "swift_env.sh").exists():
            pytest.fail("README's swift_env.sh is gone")
        done = _run(list(argv), tmp_path)
        assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs[" ".join(argv[:2])] = done.stdout
    best = list((tmp_path / "runs").glob("*/best"))
    assert best and all((b / "launch.sh").is_file() and (b / "swift.sh").is_file() for b in best)
    KEEPS_ITS_WORD[runner_of(ALL[index])](best[0].parent, outputs)


def runner_of(block: list[list[str]]) -> str:
    """The runner of a block's search: ``sim``, ``trl`` (README's CPU rehearsal), ``swift``."""
    search = next(c for c in block if c[:2] == ["autotune", "search"])
    return flags(search).get("--runner", "trl")


def search_of(runner: str) -> list[str]:
    """README's search command with ``runner`` (one block of each, as the first test checks)."""
    return next(
        c
        for b in ALL
        if runs_here(b) and runner_of(b) == runner
        for c in b
        if c[:2] == ["autotune", "search"]
    )


def sim_example_keeps_its_word(study: Path, outputs: dict[str, str]) -> None:
    """README's sim search: "you watch trials run, some run out of memory, ... At the end
    `runs/<study>/best/` holds the configuration to launch". Every trial's files, the real SQLite
    study, `show --json` and `export` (also into a folder that holds other things) on the study it
    made."""
    search = outputs["autotune search"]
    limit = int(flags(search_of("sim"))["--trials"])
    got = {int(f.parent.name): json.loads(f.read_text()) for f in (study / "trials").glob("*/outcome.json")}
    launched = [o for o in got.values() if o["launched"]]
    assert len(launched) <= limit and all(o["status"] != "invalid" for o in launched)
    # --trials is a ceiling: a search that converged earlier says so on its last line
    last = search.strip().splitlines()[-1]
    assert last.startswith(f"stopped after {len(launched)} trials: ")
    reason = last.split(": ", 1)[1]
    assert reason.startswith("converged") or (reason == "the --trials limit" and len(launched) == limit), last
    assert any(o["status"] == "oom" for o in got.values()), "a 7B search on 80 GB should meet OOMs"
    ok = [o for o in got.values() if o["status"] == "ok"]
    assert ok and all(o["throughput"] > 0 and o["peak_memory_gib"] > 0 for o in ok)
    for n, o in got.items():
        d = study / "trials" / str(n)
        if o["status"] in ("ok", "oom"):
            assert (d / "params.json").exists()
            if o["launched"]:
                assert (d / "command.txt").exists() and (d / "stdout.log").exists()
                assert (d / "metrics.jsonl").exists() or o["status"] == "oom"
    best = study / "best"
    params = json.loads((best / "params.json").read_text())
    best_ok = max(ok, key=lambda o: o["throughput"])
    assert best_ok["peak_memory_gib"] <= 79.3
    assert all(not isinstance(v, (dict, list)) for v in params.values())
    cfg = yaml.safe_load((best / "grpo_config.yaml").read_text())
    assert cfg["per_device_train_batch_size"] == params["per_device_train_batch_size"]
    summary = (best / "summary.md").read_text()
    assert "completions/s" in summary and "oom" in summary.lower()
    assert "best: trial" in search
    # storage is real SQLite with every trial in it
    with sqlite3.connect(study / "study.db") as db:
        (count,) = db.execute("select count(*) from trials").fetchone()
    assert count == len(got)
    cwd, name = study.parent.parent, study.name
    rows = json.loads(_run(["autotune", "show", name, "--json"], cwd).stdout)
    assert rows[0]["throughput"] == pytest.approx(best_ok["throughput"])
    # export rewrites best/ from the study at any time
    (best / "params.json").unlink()
    again = _run(["autotune", "export", name, "--out", str(cwd / "elsewhere")], cwd)
    assert again.returncode == 0 and json.loads((cwd / "elsewhere" / "params.json").read_text()) == params
    # --out may name any folder: nothing the user has there is deleted, not even the study itself
    (cwd / "notes.md").write_text("mine\n")
    here = _run(["autotune", "export", name, "--out", "."], cwd)
    assert here.returncode == 0, here.stderr
    assert (cwd / "notes.md").read_text() == "mine\n" and (study / "study.db").exists()
    inside = _run(["autotune", "export", name, "--out", str(study)], cwd)
    assert inside.returncode == 0, inside.stderr
    assert len(json.loads(_run(["autotune", "show", name, "--json"], cwd).stdout)) == len(rows)
    assert (study / "trials").is_dir() and (study / "recipe.yaml").exists()
    onto_file = _run(["autotune", "export", name, "--out", str(cwd / "notes.md")], cwd)
    assert (
        onto_file.returncode == 2
        and onto_file.stderr.startswith("error: --out")
        and "Traceback" not in onto_file.stderr
    )


def launched_by_batch(study: Path) -> dict[int, dict]:
    """{per-device batch: outcome.json} of the study's launched trials."""
    out = {}
    for path in study.glob("trials/*/outcome.json"):
        outcome = json.loads(path.read_text())
        if outcome.get("launched"):
            out[json.loads((path.parent / "params.json").read_text())["per_device_train_batch_size"]] = (
                outcome
            )
    return out


def rehearsal_keeps_its_word(study: Path, outputs: dict[str, str]) -> None:
    """README's CPU rehearsal: "the batch of 64 raises torch's real `DefaultCPUAllocator: can't
    allocate memory` (classified `oom/host` ...); the rest run, the best is confirmed, exported and
    `verify` replays it". Then, on the same study, a configuration that runs out of memory does not
    hold, and the verdict says why."""
    trials = launched_by_batch(study)
    assert trials[64]["status"] == "oom" and trials[64]["oom_kind"] == "host", trials[64]
    assert "DefaultCPUAllocator: can't allocate memory" in trials[64]["error_line"]
    assert all(o["status"] == "ok" and o["throughput"] > 0 for b, o in trials.items() if b != 64), trials
    assert (study / "confirm").is_dir()
    best = json.loads((study / "best" / "params.json").read_text())
    assert best["per_device_train_batch_size"] != 64 and best["use_vllm"] is False
    cfg = yaml.safe_load((study / "best" / "grpo_config.yaml").read_text())
    assert (
        cfg["per_device_train_batch_size"] == best["per_device_train_batch_size"] and cfg["use_cpu"] is True
    )
    assert "held: yes" in outputs["autotune verify"] and "completions/s" in outputs["autotune verify"]
    (study / "best" / "params.json").write_text(json.dumps({**best, "per_device_train_batch_size": 64}))
    oom = _run(["autotune", "verify", study.name, "--steps", "2"], study.parent.parent)
    assert oom.returncode == 1, oom.stdout + oom.stderr
    assert "held: NO (the run failed: oom/host)" in oom.stdout


def swift_example_keeps_its_word(study: Path, outputs: dict[str, str]) -> None:
    """README's ms-swift example: "of its two trials, the batch of 64 meets ms-swift's real
    `DefaultCPUAllocator` out-of-memory and the other runs and is confirmed. `best/swift.sh` is the
    measured command minus the trial-only flags ..., naming the model by ... the local folder the
    trials loaded": the trial's argv is what the installed ms-swift version takes, and swift.sh
    trains as written."""
    trials = launched_by_batch(study)
    assert len(trials) == int(flags(search_of("swift"))["--trials"]), trials  # "of its two trials"
    assert trials[64]["status"] == "oom" and trials[64]["oom_kind"] == "host", trials[64]
    assert "DefaultCPUAllocator: can't allocate memory" in trials[64]["error_line"]
    ok = [o for b, o in trials.items() if b != 64]
    assert ok and all(o["status"] == "ok" and o["throughput"] > 0 for o in ok), trials
    # ms-swift prints no memory(GiB) on CPU: the peak is the process tree's RSS, inside the cap
    assert all(o["extra"]["peak_source"] == "host_rss" and 0.2 < o["peak_memory_gib"] < 3 for o in ok)

    best = json.loads((study / "best" / "params.json").read_text())
    trial = next(
        p.parent
        for p in study.glob("trials/*/params.json")
        if json.loads(p.read_text()) == best and (p.parent / "swift_argv.json").is_file()
    )
    saved = json.loads((trial / "swift_argv.json").read_text())
    argv, f = saved["argv"], flags(saved["argv"])
    swift = swift_program()
    assert argv[0] == str(swift) and argv[1:4] == ["rlhf", "--rlhf_type", "grpo"]
    # the version read through the script's interpreter is what pip says is installed there
    python = Path(swift.read_text().splitlines()[0][2:].strip())
    shown = subprocess.run([str(python), "-m", "pip", "show", "ms-swift"], capture_output=True, text=True)
    installed = next(
        ln.split(":", 1)[1].strip() for ln in shown.stdout.splitlines() if ln.startswith("Version:")
    )
    version = SwiftVersion.parse(saved["ms_swift"])
    assert version == SwiftVersion.parse(installed) and version >= OLDEST
    assert ("--tuner_type" in f) == (version.major >= 4) and ("--train_type" in f) == (version.major < 4)
    assert f["--model_type"] == "qwen2" and f["--template"] == "qwen"
    assert Path(f["--model"], "model.safetensors").is_file()
    confirm = [json.loads(p.read_text()) for p in study.glob("confirm/*/swift_argv.json")]
    assert confirm and all(int(flags(c["argv"])["--max_steps"]) > int(f["--max_steps"]) for c in confirm)

    sh = study / "best" / "swift.sh"
    line = next(ln for ln in sh.read_text().replace("\\\n", " ").splitlines() if ln.startswith("exec "))
    assert shlex.split(line)[1:-1] == production_argv(argv, keep_template=True)  # without "$@"
    env = {**os.environ, "PATH": f"{swift.parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
    extra = ["--max_steps", "2", "--dataset", f["--dataset"], "--reward_funcs", "format"]
    extra += ["--truncation_strategy", "left", "--output_dir", str(study.parent.parent / "swift_sh_out")]
    extra += [
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--dataset_num_proc",
        "1",
    ]
    done = subprocess.run(
        ["bash", str(sh), *extra],
        cwd=study.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "'global_step/max_steps': '2/2'" in done.stdout + done.stderr


def flags(argv: list[str]) -> dict[str, str]:
    """{--flag: the value after it} of a command line."""
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


#: what each kind of README block is checked for, on the study it made (by its search's runner)
KEEPS_ITS_WORD = {
    "sim": sim_example_keeps_its_word,
    "trl": rehearsal_keeps_its_word,
    "swift": swift_example_keeps_its_word,
}
