"""A stand-in for a trainer with its own flag names (OpenRLHF style), driven by autotune's template.

It checks its batch flags the way such trainers do (train_batch_size = micro x accumulation x
world size), runs exactly --max_steps steps, prints a log dict per step (step_time, memory(GiB);
no samples: autotune must know the batch) and first records the flags it runs with in
<output_dir>/ran.json, so a test can tell which configuration ran.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--micro_train_batch_size", type=int, required=True)
p.add_argument("--grad_accum", type=int, required=True)
p.add_argument("--n_samples_per_prompt", type=int, required=True)
p.add_argument("--train_batch_size", type=int, required=True)
p.add_argument("--max_steps", type=int, required=True)
p.add_argument("--run_name", required=True)
p.add_argument("--output_dir", required=True)
a = p.parse_args()
world = int(os.environ.get("NPROC_PER_NODE", "1"))
if a.train_batch_size != a.micro_train_batch_size * a.grad_accum * world:
    sys.exit(
        f"ValueError: train_batch_size {a.train_batch_size} != micro_train_batch_size "
        f"{a.micro_train_batch_size} x grad_accum {a.grad_accum} x world size {world}"
    )
if a.train_batch_size % a.n_samples_per_prompt:
    sys.exit(f"ValueError: train_batch_size {a.train_batch_size} is not a multiple of n_samples_per_prompt")
out = Path(a.output_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "ran.json").write_text(json.dumps({**vars(a), "world": world}))
print("loading model", flush=True)
for step in range(1, a.max_steps + 1):
    # a micro-step costs a fixed overhead plus the completions in it: bigger micro-batches are faster
    step_time = a.grad_accum * (0.004 + 0.001 * a.micro_train_batch_size)
    time.sleep(0.005)
    print(
        {
            "loss": 0.1,
            "step_time": step_time,
            "memory(GiB)": 10 + 6 * a.micro_train_batch_size,
            "epoch": step / 100,
        },
        flush=True,
    )
