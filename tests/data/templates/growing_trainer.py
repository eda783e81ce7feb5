"""A template trainer whose memory grows with the step, as GRPO's does when completions get longer.

Each step really allocates ``batch x (7 + step) x UNIT`` bytes, so under a real
RLIMIT_AS cap (``--memory-limit``) a large batch dies with Python's real ``MemoryError`` at a later
step than a short trial reaches. It keeps autotune's run contract: it saves ``checkpoint-<step>``
folders in ``--output_dir`` every ``$AUTOTUNE_SAVE_STEPS`` steps (and when it gets SIGTERM), resumes
from ``$AUTOTUNE_RESUME_FROM``, and appends the metrics contract's JSON lines (step, step_time,
samples) to ``$AUTOTUNE_METRICS_FILE``. Its numbers are in units of ``UNIT`` bytes; see
tests/test_production.py for why the sizes are what they are.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

UNIT = int(float(os.environ.get("GROWING_UNIT_MIB", "8.65")) * 2**20)

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, required=True)
p.add_argument("--accum", type=int, required=True)
p.add_argument("--max_steps", type=int, required=True)
p.add_argument("--output_dir", required=True)
a = p.parse_args()
out = Path(a.output_dir)
out.mkdir(parents=True, exist_ok=True)
save_every = int(os.environ.get("AUTOTUNE_SAVE_STEPS") or 1)
metrics = os.environ.get("AUTOTUNE_METRICS_FILE")
stopping = []
signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))


def save(step: int, why: str) -> None:
    folder = out / f"checkpoint-{step}"
    folder.mkdir()  # never over an existing checkpoint: exists -> FileExistsError
    (folder / "state.json").write_text(
        json.dumps({"step": step, "batch": a.batch, "accum": a.accum, "why": why})
    )


start = 0
resume = os.environ.get("AUTOTUNE_RESUME_FROM")
if resume:
    start = json.loads((Path(resume) / "state.json").read_text())["step"]
    print(f"resumed from {resume} at step {start}", flush=True)
(out / "ran.json").write_text(json.dumps({**vars(a), "start": start}))
for step in range(start + 1, a.max_steps + 1):
    began = time.perf_counter()
    size = a.batch * (7 + step) * UNIT
    crash = os.environ.get("GROWING_CRASH_AT")  # "3" or "3:once-marker-file": a crash not about memory
    if crash and step == int(crash.split(":")[0]):
        marker = Path(crash.split(":")[1]) if ":" in crash else None
        if marker is None or not marker.exists():
            if marker is not None:
                marker.write_text("crashed once")
            raise RuntimeError("NCCL watchdog: connection reset by peer")
    # MemoryError under the cap: the real one, raised by the allocator. bytes(n) is calloc'ed, so
    # the pages are mapped but never touched: RLIMIT_AS caps address space, so the mapping itself
    # is what fails, and the step's time is its sleep, not the zeroing of a large buffer (which
    # made smaller batches look faster per completion and the search's choice depend on noise)
    buf = bytes(size)
    time.sleep(a.accum * (0.04 + 0.01 * a.batch))  # bigger micro-batches are faster per completion
    del buf
    record = {"step": step, "step_time": time.perf_counter() - began, "samples": a.batch * a.accum}
    print(json.dumps(record), flush=True)
    if metrics:
        with open(metrics, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    if stopping:
        save(step, "SIGTERM")
        print(f"SIGTERM: saved checkpoint-{step}", flush=True)
        sys.exit(143)
    if step % save_every == 0 or step == a.max_steps:
        save(step, "schedule")
print("done", flush=True)
