"""The fake GRPO trainer process: plays one trial of the landscape as a real trainer would look.

Why imitate so closely: the runner, monitor and outcome classifier are meant to work on real TRL /
DeepSpeed / vLLM runs. Rehearsing them against a process that prints the same kind of log lines,
log dicts, tracebacks and exit codes (and dies by SIGKILL for a host OOM) exercises the same code
paths without a GPU. Time is simulated: every simulated second sleeps ``time_scale`` wall seconds,
while every number printed (``step_time``, ``train_runtime``) is in simulated seconds.

Printing (not logging) is deliberate here: this process *is* the trainer's stdout/stderr.

Spec keys used here besides what the landscape reads: ``time_scale`` (wall seconds per simulated
second, default 0.002), ``metrics_file`` (false: stdout only), ``log_style`` ("float" prints log
dicts as transformers 4.x does; "str" as transformers 5.x does, floats formatted '.4g' strings),
``model`` (name shown in log lines), ``gpu_csv`` (false: no gpu.csv), ``warmup_steps`` (phases in
gpu.csv, default 2). Environment: ``AUTOTUNE_METRICS_FILE`` (JSON lines appended),
``AUTOTUNE_TRIAL_DIR`` (where gpu.csv goes: the utilization NVML would have shown, see ``gpu_trace``).

The failure texts (tracebacks; CUDA, vLLM and TRL error messages) and the log timestamps are
rendered in ``error_text``; this module plays the trial and exits the way the failure demands.

Exit: 0 after max_steps; 1 with the error text on stderr for CUDA / vLLM / config failures;
SIGKILL (returncode -9) for host OOM; 2 with one line on stderr for a bad spec; SIGTERM's default.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from autotune.sim.error_frames import ds_ts, vllm_ts
from autotune.sim.error_text import failure_text
from autotune.sim.gpu_trace import GpuTrace
from autotune.sim.landscape import Scenario, SpecError, TrialTruth, evaluate, parse_spec

DATASET_ROWS = 7473  # prompts in the (simulated) training set, for the `epoch` field


class BadSpec(Exception):
    """The spec file is missing or malformed: one line on stderr, exit 2."""


def load_spec(path: str) -> dict[str, Any]:
    """Read and minimally check the spec JSON (the landscape validates the rest)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise BadSpec(f"cannot read spec {path}: {e.strerror or e}") from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadSpec(f"spec {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(spec, dict):
        raise BadSpec(f"spec {path} must hold a JSON object")
    return spec


@dataclass
class SimTrainer:
    """Plays one trial: start-up lines, one log dict + metrics line per step, then success or the
    failure the landscape decided, with the matching text and exit."""

    spec: dict[str, Any]
    truth: TrialTruth
    sc: Scenario
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr

    def __post_init__(self) -> None:
        self.time_scale = float(self.spec.get("time_scale", 0.002) or 0.0)
        mf = self.spec.get("metrics_file", True)
        self.metrics_path = os.environ.get("AUTOTUNE_METRICS_FILE") if mf is not False else None
        self.model_name = str(
            self.spec.get("model") or self.spec["model_config"].get("_name_or_path") or "model"
        )
        self.log_style = str(self.spec.get("log_style", "float"))
        # log values (loss, rewards) only need to look plausible; keep them reproducible per seed
        self.rng = random.Random(f"{self.sc.seed}-logs")
        trial_dir = os.environ.get("AUTOTUNE_TRIAL_DIR")
        self.gpu_dir = Path(trial_dir) if trial_dir and self.spec.get("gpu_csv", True) is not False else None

    # -- plumbing ----------------------------------------------------------------------------
    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        self.err.write(text if text.endswith("\n") else text + "\n")
        self.err.flush()

    def wait(self, sim_seconds: float) -> None:
        """Sleep the wall-clock equivalent of `sim_seconds` of simulated time."""
        if self.time_scale > 0 and sim_seconds > 0:
            time.sleep(sim_seconds * self.time_scale)

    # -- start-up ----------------------------------------------------------------------------
    def startup(self) -> None:
        """Print what a TRL + DeepSpeed + vLLM start-up prints, up to where this trial fails."""
        t, k, info = self.truth, self.sc.k, self.truth.info
        f = t.failure
        phases = info.get("phases") or {}
        ph_import = phases.get("import", t.startup_s)
        self.wait(min(ph_import, t.startup_s))
        # every zero_stage, 0 included, runs under DeepSpeed in this simulation
        self.say(
            f"[{ds_ts()}] [INFO] [real_accelerator.py:260:get_accelerator] Setting ds_accelerator "
            "to cuda (auto detect)"
        )
        if k.use_vllm:
            self.say(f"INFO {vllm_ts()} [__init__.py:241] Automatically detected platform cuda.")
        if f is not None and f.kind == "invalid":
            self.wait(t.startup_s - ph_import)
            return

        load = phases.get("load", 0.0)
        self.wait(load)
        n_shards = max(1, round(info.get("params_b", 1.0) * 2 / 4.5))
        self.warn(
            f"Loading checkpoint shards: 100%|██████████| {n_shards}/{n_shards} "
            f"[00:{min(int(load * 0.6), 59):02d}<00:00, {load * 0.6 / n_shards:.2f}s/it]"
        )

        ds = phases.get("deepspeed", 0.0)
        stage_failed = f is not None and f.at_step == 0 and f.kind in ("cuda", "host")
        self.say(
            f"[{ds_ts()}] [INFO] [logging.py:107:log_dist] [Rank 0] DeepSpeed info: "
            "version=0.17.5, git-hash=unknown, git-branch=unknown"
        )
        if k.zero == 3:
            self.say(
                f"[{ds_ts()}] [INFO] [logging.py:107:log_dist] [Rank 0] Creating ZeRO stage 3 "
                "optimizer, MiCS is enabled False, Hierarchical params gather False"
            )
        elif k.zero in (1, 2):
            self.say(
                f"[{ds_ts()}] [INFO] [stage_1_and_2.py:151:__init__] Reduce bucket size "
                f"{int(self.sc.m.hidden**2)}"
            )
            self.say(
                f"[{ds_ts()}] [INFO] [logging.py:107:log_dist] [Rank 0] Creating torch.bfloat16 "
                f"ZeRO stage {k.zero} optimizer"
            )
        else:
            self.say(f"[{ds_ts()}] [INFO] [logging.py:107:log_dist] [Rank 0] Creating BF16 optimizer")
        self.say(
            f"[{ds_ts()}] [INFO] [stage_1_and_2.py:154:__init__] CPU Offload: {k.offload_opt}"
            if k.zero in (1, 2)
            else f"[{ds_ts()}] [INFO] [config.py:1000:print] zero_optimization.offload_optimizer  "
            f"device={'cpu' if k.offload_opt else 'none'} offload_param "
            f"device={'cpu' if k.offload_params else 'none'}"
        )
        self.wait(ds * (0.6 if stage_failed else 1.0))
        if stage_failed:
            return
        states = info.get("states_gib", 0.0)
        self.say(f"[{ds_ts()}] [INFO] [utils.py:781:see_memory_usage] After initializing ZeRO optimizer")
        self.say(
            f"[{ds_ts()}] [INFO] [utils.py:782:see_memory_usage] MA {states * 1.0737:.2f} GB         "
            f"Max_MA {states * 1.0737 * 1.04:.2f} GB         CA {states * 1.0737 * 1.01:.2f} GB         "
            f"Max_CA {states * 1.0737 * 1.05:.0f} GB "
        )
        host_used = info.get("host_init_gib", 20.0)
        self.say(
            f"[{ds_ts()}] [INFO] [utils.py:789:see_memory_usage] CPU Virtual Memory:  used = "
            f"{host_used * 1.0737:.2f} GB, percent = {100 * host_used / max(self.sc.host_gib, 1):.1f}%"
        )
        if k.use_vllm:
            self._vllm_startup()

    def _vllm_startup(self) -> None:
        t, k, info = self.truth, self.sc.k, self.truth.info
        f = t.failure
        vphase = (info.get("phases") or {}).get("vllm", 0.0)
        mml = info.get("max_model_len", self.sc.prompt + self.sc.completion)
        self.say(
            f"INFO {vllm_ts()} [core.py:654] Initializing a V1 LLM engine (v0.10.2) with config: "
            f"model='{self.model_name}', speculative_config=None, tokenizer='{self.model_name}', "
            f"skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, trust_remote_code=False, "
            f"dtype=torch.bfloat16, max_seq_len={mml}, download_dir=None, load_format=auto, "
            f"tensor_parallel_size={k.tp}, pipeline_parallel_size=1, data_parallel_size=1, "
            f"disable_custom_all_reduce=False, quantization=None, enforce_eager=False, "
            f"kv_cache_dtype=auto, device_config=cuda, seed=0, served_model_name={self.model_name}, "
            f"enable_prefix_caching=True, chunked_prefill_enabled=True"
        )
        if f is not None and f.kind == "vllm_startup":
            self.wait(
                max(
                    t.startup_s
                    - sum((info.get("phases") or {}).get(p, 0.0) for p in ("import", "load", "deepspeed")),
                    0.0,
                )
            )
            return
        self.wait(vphase * 0.3)
        self.say(
            f"INFO {vllm_ts()} [gpu_model_runner.py:1953] Model loading took "
            f"{info.get('vllm_weights_gib', 0.0):.4f} GiB and {vphase * 0.2:.6f} seconds"
        )
        self.wait(vphase * 0.2)
        kv = info.get("kv_avail_gib", 0.0)
        self.say(f"INFO {vllm_ts()} [gpu_worker.py:276] Available KV cache memory: {kv:.2f} GiB")
        if f is not None and f.kind == "vllm_kv":
            return
        tokens = int(info.get("kv_tokens", 0))
        self.say(f"INFO {vllm_ts()} [kv_cache_utils.py:849] GPU KV cache size: {tokens:,} tokens")
        self.say(
            f"INFO {vllm_ts()} [kv_cache_utils.py:853] Maximum concurrency for {mml:,} tokens per "
            f"request: {info.get('max_concurrency', 0.0):.2f}x"
        )
        self.say(
            f"INFO {vllm_ts()} [executor_base.py:113] # cuda blocks: {int(info.get('gpu_blocks', 0))}, "
            "# CPU blocks: 0"
        )
        self.wait(vphase * 0.5)
        self.say(
            f"INFO {vllm_ts()} [gpu_model_runner.py:2708] Graph capturing finished in "
            f"{int(vphase * 0.4)} secs, took {info.get('graphs_gib', 0.4):.2f} GiB"
        )
        self.say(
            f"INFO {vllm_ts()} [core.py:214] init engine (profile, create kv cache, warmup model) "
            f"took {vphase * 0.7:.2f} seconds"
        )
        if k.sleep:
            freed = info.get("vllm_budget_gib", 0.0) - info.get("graphs_gib", 0.4) - 0.3
            self.say(
                f"INFO {vllm_ts()} [gpu_worker.py:104] Sleep mode freed {freed:.2f} GiB memory, "
                f"{t.startup_peak_gib - freed:.2f} GiB memory is still in use."
            )
        self.wait(2.0)

    # -- steps -------------------------------------------------------------------------------
    def log_dict(self, step: int, step_time: float, loss: float, tokens_so_far: int) -> dict[str, Any]:
        """The dict TRL's GRPOTrainer logs for one optimizer step (keys in TRL's order)."""
        sc, r = self.sc, self.rng
        C = float(sc.completion)
        lr = 1e-06 * (1.0 - (step - 1) / max(sc.max_steps, 1))
        reward = min(max(0.05 + 0.004 * step + r.gauss(0, 0.03), 0.0), 1.0)
        prompts_per_step = self.truth.samples_per_step / max(sc.k.num_gen, 1)
        d: dict[str, Any] = {
            "loss": round(loss, 4),
            "grad_norm": round(abs(r.gauss(0.35, 0.12)) + 0.02, 6),
            "learning_rate": lr,
            "num_tokens": float(tokens_so_far),
            "completions/mean_length": C,
            "completions/min_length": C,
            "completions/max_length": C,
            "completions/clipped_ratio": 1.0,
            "completions/mean_terminated_length": 0.0,
            "completions/min_terminated_length": 0.0,
            "completions/max_terminated_length": 0.0,
            "rewards/accuracy_reward/mean": reward,
            "rewards/accuracy_reward/std": round(abs(r.gauss(0.2, 0.05)), 6),
            "reward": reward,
            "reward_std": round(abs(r.gauss(0.18, 0.05)), 6),
            "frac_reward_zero_std": round(min(max(r.gauss(0.7, 0.1), 0.0), 1.0), 6),
            "entropy": round(abs(r.gauss(0.45, 0.05)), 6),
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/low_min": 0.0,
            "clip_ratio/high_mean": 0.0,
            "clip_ratio/high_max": 0.0,
            "clip_ratio/region_mean": 0.0,
            "step_time": round(step_time, 4),
            "epoch": round(step * prompts_per_step / DATASET_ROWS, 4),
        }
        return d

    def show(self, d: dict[str, Any]) -> None:
        """Print a log dict as transformers does: 4.x prints floats as is, 5.x as '.4g' strings."""
        if self.log_style == "str":
            d = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in d.items()}
        self.say(str(d))

    def write_metrics(self, rec: dict[str, Any]) -> None:
        if not self.metrics_path:
            return
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def run(self) -> int:
        """Play the trial; returns the exit status (or never returns: SIGKILL)."""
        t = self.truth
        self.startup()
        f = t.failure
        # a config TRL rejects dies before it touches a GPU: nothing to sample
        invalid = f is not None and f.kind == "invalid"
        trace = (
            GpuTrace(self.gpu_dir, t, self.sc, self.spec)
            if self.gpu_dir is not None and not invalid
            else None
        )
        if trace is not None:
            trace.startup()
        if f is not None and f.at_step == 0:
            if trace is not None:
                trace.close()
            return self.die()
        peak_so_far = t.startup_peak_gib
        tokens_so_far = 0
        losses: list[float] = []
        for i, (st, gen, train, peak) in enumerate(
            zip(t.step_times, t.generation_times, t.training_times, t.peak_memory_gib), start=1
        ):
            self.wait(st)
            peak_so_far = max(peak_so_far, peak)
            if trace is not None:
                trace.step(i, gen, train, peak)
            tokens_so_far += t.tokens_per_step
            loss = self.rng.gauss(0.0, 0.015)
            losses.append(round(loss, 4))
            self.show(self.log_dict(i, st, loss, tokens_so_far))
            self.write_metrics(
                {
                    "step": i,
                    "step_time": round(st, 4),
                    "samples": t.samples_per_step,
                    "tokens": t.tokens_per_step,
                    "peak_memory_gib": round(peak_so_far, 3),
                    "generation_time": round(gen, 4),
                    "training_time": round(train, 4),
                }
            )
        if f is not None:
            self.wait(t.fail_after_s)
            if trace is not None:
                last_gen = t.generation_times[-1] if t.generation_times else 0.0
                trace.failing_step(f.at_step, t.fail_after_s, last_gen, peak_so_far, f.kind == "cuda")
                trace.close()
            return self.die()
        if trace is not None:
            trace.close()
        runtime = sum(t.step_times)
        steps = len(t.step_times)
        prompts_per_step = t.samples_per_step / max(self.sc.k.num_gen, 1)
        self.show(
            {
                "train_runtime": round(runtime, 4),
                "train_samples_per_second": round(steps * t.samples_per_step / runtime, 3)
                if runtime
                else 0.0,
                "train_steps_per_second": round(steps / runtime, 3) if runtime else 0.0,
                "train_loss": sum(losses) / len(losses) if losses else 0.0,
                "epoch": round(steps * prompts_per_step / DATASET_ROWS, 4),
            }
        )
        return 0

    # -- failures ----------------------------------------------------------------------------
    def die(self) -> int:
        """Print the failure's real-world text and return 1 (or SIGKILL ourselves for host OOM)."""
        f = self.truth.failure
        assert f is not None
        if f.kind == "host":
            # The kernel OOM killer leaves no traceback: the process just vanishes with signal 9.
            self.out.flush()
            self.err.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(5)  # not reached
            return 137
        self.warn(failure_text(self.spec, self.sc, self.truth))
        return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m autotune.sim --spec FILE``."""
    args = list(sys.argv[1:] if argv is None else argv)
    spec_path = None
    if len(args) == 2 and args[0] == "--spec":
        spec_path = args[1]
    elif len(args) == 1 and args[0].startswith("--spec="):
        spec_path = args[0].split("=", 1)[1]
    if not spec_path:
        sys.stderr.write("error: usage: python -m autotune.sim --spec SPEC.json\n")
        return 2
    try:
        spec = load_spec(spec_path)
        sc = parse_spec(spec)
        truth = evaluate(spec)
    except (BadSpec, SpecError) as e:
        sys.stderr.write(f"error: bad sim spec: {e}\n")
        return 2
    trainer = SimTrainer(spec=spec, truth=truth, sc=sc)
    return trainer.run()
