"""Every shell command in README.md works as written: a README change that breaks one fails here.

The ```bash blocks are read from README.md itself. Every ``autotune`` command is parsed by the
real CLI (its subcommand and each flag and value, as click parses them, without running it); the
blocks meant for this machine (``--runner sim``, ``--device cpu``) run exactly as written, in a
fresh folder, slow. The GPU-only blocks stay at the parse level. README's install line
(``pip install -e ".[test]"``) made this environment and is not run again; ``python -m pytest`` is
this suite itself.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

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
    best/ (launch.sh, swift.sh)."""
    for argv in ALL[index] + follow_ups(index):
        if is_install(argv):
            continue
        if argv[0] == "bash" and not (ROOT / "scripts" / "swift_env.sh").exists():
            pytest.fail("README's swift_env.sh is gone")
        done = _run(list(argv), tmp_path)
        assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    best = list((tmp_path / "runs").glob("*/best"))
    assert best and all((b / "launch.sh").is_file() and (b / "swift.sh").is_file() for b in best)
