"""Issue 9, a trial's output streams: a log that cannot be written (fault 7) and output floods
(fault 8). Real trial processes, real pipes, real files (/dev/full is a disk that is always full)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune.trial import streams
from autotune.trial.launch import LaunchSpec, launch

# the bounds a trial's stream is held to (getattr: this file also runs against the code before them)
LINE_MAX = streams.LINE_MAX
LOG_CAP = streams.LOG_CAP
LOG_END = streams.LOG_END


def spec(tmp_path: Path, code: str) -> LaunchSpec:
    script = tmp_path / "trial.py"
    script.write_text(textwrap.dedent(code))
    return LaunchSpec(
        argv=[sys.executable, str(script)], env={"AUTOTUNE_TRIAL_DIR": str(tmp_path)}, trial_dir=tmp_path
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_costs_the_log_not_the_trial(tmp_path, caplog):
    """Fault 7: the reader thread died on ENOSPC, the pipe filled, and the trial was recorded as a hang."""
    (tmp_path / "stdout.log").symlink_to("/dev/full")  # every write: No space left on device
    code = """
        for i in range(3000):
            print(f"step {i} " + "x" * 100, flush=True)
        print("done", flush=True)
    """
    seen: list[str] = []
    result = launch(
        spec(tmp_path, code),
        on_line=lambda s, line: seen.append(line),
        should_stop=lambda: None,
        trial_timeout_s=60,
        hang_timeout_s=3,
        grace_s=1,
    )
    assert result.stopped is None and result.returncode == 0
    assert len(seen) == 3001 and seen[-1] == "done"
    assert "done" in result.log_tail
    (note,) = result.notes
    assert "stdout.log could not be written" in note and "No space left" in note
    assert sum("could not be written" in r.getMessage() for r in caplog.records) == 1  # noted once


# The launch runs in a process of its own so its peak memory is its own: VmHWM, the high-water mark
# of this process's memory map (ru_maxrss would carry over the forking pytest's from before exec).
CONTROLLER = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path
    from autotune.trial.launch import LaunchSpec, launch
    trial = Path(sys.argv[1])
    longest = [0]
    def on_line(stream, text):
        longest[0] = max(longest[0], len(text.encode()))
    spec = LaunchSpec(argv=[sys.executable, sys.argv[2]], env={"AUTOTUNE_TRIAL_DIR": str(trial)}, trial_dir=trial)
    result = launch(spec, on_line=on_line, should_stop=lambda: None, trial_timeout_s=120, hang_timeout_s=60)
    hwm = re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())
    print(json.dumps({"rss_mib": int(hwm.group(1)) / 1024,
                      "longest": longest[0], "returncode": result.returncode, "notes": getattr(result, "notes", []),
                      "tail_len": len(result.log_tail), "tail_end": result.log_tail[-200:],
                      "wall": result.wall_time_s}))
""")


def test_huge_lines_keep_the_controller_small_and_the_log_capped(tmp_path):
    """Fault 8: five 100 MB lines took the controller to 2.1 GB, and the log had no cap."""
    trial = tmp_path / "trial"
    trial.mkdir()
    trainer = tmp_path / "flood.py"
    trainer.write_text(
        textwrap.dedent("""
        import sys
        block = b"{" * (40 * 2**20)                      # 40 MB, no newline
        for _ in range(3):
            sys.stdout.buffer.write(block)
        sys.stdout.buffer.write(b"\\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\\n")
        sys.stdout.flush()
        sys.exit(1)
    """)
    )
    controller = tmp_path / "controller.py"
    controller.write_text(CONTROLLER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    done = subprocess.run(
        [sys.executable, str(controller), str(trial), str(trainer)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["rss_mib"] < 150, got  # bounded, whatever the line length
    assert got["longest"] <= LINE_MAX  # over-long lines are cut
    assert got["tail_len"] <= 256 * 1024 + LINE_MAX  # the tail is kept by bytes
    assert "CUDA out of memory" in got["tail_end"]  # and still ends with the root cause
    log_file = trial / "stdout.log"
    size = log_file.stat().st_size
    assert LOG_CAP <= size <= LOG_CAP + LOG_END + 500, size
    with open(log_file, "rb") as f:
        f.seek(LOG_CAP)
        rest = f.read()
    assert b"[autotune] stdout.log capped at" in rest and b"bytes dropped" in rest
    assert rest.rstrip().endswith(b"CUDA out of memory. Tried to allocate 2 GiB")
    assert any("capped" in n for n in got["notes"])


def test_a_flood_of_lines_does_not_hold_off_the_timeout(tmp_path):
    """Fault 8: while lines kept coming the loop never looked at the clock, so the timeout fired late."""
    code = """
        import time
        for i in range(10000):
            print(f"{{'loss': 0.1, 'step': {i}}}", flush=True)
        time.sleep(600)
    """
    calls = [0]

    def slow_parser(stream: str, line: str) -> None:  # a parse that costs 1 ms a line
        calls[0] += 1
        time.sleep(0.001)

    result = launch(
        spec(tmp_path, code),
        on_line=slow_parser,
        should_stop=lambda: None,
        trial_timeout_s=1.5,
        hang_timeout_s=60,
        grace_s=1,
    )
    assert result.stopped == "timeout"
    assert result.wall_time_s < 1.5 + 12, result.wall_time_s  # the flood held it off 47.6 s
    assert calls[0] > 100
