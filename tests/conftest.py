"""Fixtures and helpers shared by the test modules.

Test modules import helpers from here (``from conftest import ...``), never from one another:
a helper that two topics need lives in this one place (tests/test_architecture.py checks it).
"""

import contextlib
import hashlib
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from autotune.units import GIB


def pytest_configure(config):
    """The suite as started in the background (``nohup bash .ci/run &``) inherits SIGINT and SIGHUP
    ignored, and so would every controller a test starts: the signal tests would test the shell,
    not autotune. A user's terminal gives the defaults; so do we."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    # A CPU trial runs torch on as many OpenMP threads as there are cores (the runners set
    # OMP_NUM_THREADS), and the suite runs two of them at once on 2 cores (two xdist workers).
    # OpenMP's threads then spin-wait for cores the other trial holds: two tiny-qwen trials side by
    # side took 5.5 s a step each instead of 2 (1.2 alone). Waiting threads that sleep instead give
    # the same trials, trained the same way; every trial and command the suite starts inherits it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recipe_factory():
    from autotune.recipe import Recipe

    def make(**kw):
        base = dict(model="Qwen2.5-7B-Instruct", gpus=4, gpu_type="A100-80GB", gpu_memory_gib=79.3)
        base.update(kw)
        return Recipe(**base)

    return make


def run_cli(*args, cwd=None, env=None, timeout=300, input=None):
    """Run the real console entry point in a subprocess (exit codes and stderr as a user sees)."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "autotune", *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


def bench_script(name: str, *args: str, cwd: Path | None = None, timeout: int = 600):
    """One of the benchmark's scripts (scripts/NAME) run as a user types it, from ``cwd``."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, str(root / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def saved_activation_bytes(module, call) -> int:
    """Bytes autograd keeps for backward while ``call()`` runs ``module`` (each storage once,
    floating point, the module's own parameters left out): the activations the memory model counts."""
    import torch

    params = {p.data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.dtype.is_floating_point:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(saved.values())


# --- the bad-input contract: one line, exit 2 ------------------------------------------------


def one_line_error(res, *fragments):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr and len(err.splitlines()) == 1, err
    assert err.startswith("error:"), err
    for f in fragments:
        assert f in err, (f, err)


# --- NVML replayed (no GPU on CI) -------------------------------------------------------------

H100_TOTAL_GIB = 79.65  # what nvmlDeviceGetMemoryInfo(h).total reports on an 80 GB H100, in GiB


class ReplayNvml:
    """pynvml's API over recorded per-GPU ``(util %, memory used GiB)`` sequences.

    Each ``nvmlDeviceGetMemoryInfo`` call moves that GPU to its next sample (the sampler reads
    utilization first, then memory), and the last sample repeats. ``processes`` maps a GPU to pids
    for ``nvmlDeviceGetComputeRunningProcesses``; ``fail`` maps (gpu, call name) to an NVML error code.
    """

    def __init__(
        self,
        samples: dict[int, list[tuple[float, float]]],
        *,
        total_gib: float = H100_TOTAL_GIB,
        processes: dict[int, list[int]] | None = None,
        fail: dict[tuple[int, str], int] | None = None,
        init_error: int | None = None,
    ) -> None:
        self.samples = samples
        self.total_gib = total_gib
        self.processes = processes or {}
        self.fail = fail or {}
        self.init_error = init_error
        self.cursor = {i: 0 for i in samples}
        self.inits = self.shutdowns = self.memory_calls = 0

    def _check(self, index: int, name: str) -> None:
        if (index, name) in self.fail:
            raise pynvml.NVMLError(self.fail[(index, name)])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.samples)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def current(self, index: int) -> tuple[float, float]:
        seq = self.samples[index]
        return seq[min(self.cursor[index], len(seq) - 1)]

    def used_gib(self, index: int) -> float:
        return self.current(index)[1]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> pynvml.c_nvmlUtilization_t:
        self._check(handle, "util")
        return pynvml.c_nvmlUtilization_t(gpu=int(self.current(handle)[0]), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> pynvml.c_nvmlMemory_t:
        self._check(handle, "memory")
        self.memory_calls += 1
        used = int(self.used_gib(handle) * GIB)
        total = int(self.total_gib * GIB)
        self.cursor[handle] += 1
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        return [
            pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_v2_t(pid=pid, usedGpuMemory=GIB))
            for pid in self.processes.get(handle, [])
        ]


# --- recorded gpu.csv timelines ---------------------------------------------------------------

# gpu.csv of the write-up 004 run, as GpuSampler writes it (2 GPUs, one sample every 0.5 s)
SWING_CSV = textwrap.dedent("""\
    time_s,phase,gpu,util_pct,mem_used_gib,mem_total_gib,host_rss_gib,host_cpu_pct
    0.000,start,0,0,0.512,79.647,2.100,98.0
    0.000,start,1,0,0.498,79.647,2.100,98.0
    5.000,warmup,0,88,40.950,79.647,61.300,240.0
    5.000,warmup,1,85,40.700,79.647,61.300,240.0
    10.000,measure,0,87,41.200,79.647,62.400,205.0
    10.000,measure,1,87,40.900,79.647,62.400,205.0
    10.500,measure,0,85,41.200,79.647,62.400,205.0
    10.500,measure,1,87,40.900,79.647,62.400,205.0
    11.000,measure,0,91,41.200,79.647,62.400,205.0
    11.000,measure,1,89,40.900,79.647,62.400,205.0
    11.500,measure,0,85,41.200,79.647,62.400,205.0
    11.500,measure,1,82,40.900,79.647,62.400,205.0
    12.000,measure,0,84,41.200,79.647,62.400,205.0
    12.000,measure,1,86,40.900,79.647,62.400,205.0
    12.500,measure,0,92,41.200,79.647,62.400,205.0
    12.500,measure,1,92,40.900,79.647,62.400,205.0
    13.000,measure,0,6,23.500,79.647,62.400,310.0
    13.000,measure,1,2,23.100,79.647,62.400,310.0
    13.500,measure,0,1,23.500,79.647,62.400,310.0
    13.500,measure,1,5,23.100,79.647,62.400,310.0
    14.000,measure,0,4,23.500,79.647,62.400,310.0
    14.000,measure,1,5,23.100,79.647,62.400,310.0
    14.500,measure,0,72,31.800,79.647,62.400,260.0
    14.500,measure,1,70,31.200,79.647,62.400,260.0
    15.000,measure,0,61,31.800,79.647,62.400,260.0
    15.000,measure,1,61,31.200,79.647,62.400,260.0
    15.500,measure,0,68,31.800,79.647,62.400,260.0
    15.500,measure,1,64,31.200,79.647,62.400,260.0
    16.000,measure,0,71,31.800,79.647,62.400,260.0
    16.000,measure,1,71,31.200,79.647,62.400,260.0
    16.500,measure,0,67,31.800,79.647,62.400,260.0
    16.500,measure,1,65,31.200,79.647,62.400,260.0
    17.000,measure,0,2,18.400,79.647,63.100,1380.0
    17.000,measure,1,2,18.100,79.647,63.100,1380.0
    17.500,measure,0,2,18.400,79.647,63.100,1380.0
    17.500,measure,1,0,18.100,79.647,63.100,1380.0
    18.000,measure,0,4,18.400,79.647,63.100,1380.0
    18.000,measure,1,5,18.100,79.647,63.100,1380.0
    18.500,measure,0,90,41.200,79.647,62.400,205.0
    18.500,measure,1,94,40.900,79.647,62.400,205.0
    19.000,measure,0,87,41.200,79.647,62.400,205.0
    19.000,measure,1,85,40.900,79.647,62.400,205.0
    19.500,measure,0,87,41.200,79.647,62.400,205.0
    19.500,measure,1,90,40.900,79.647,62.400,205.0
    20.000,measure,0,88,41.200,79.647,62.400,205.0
    20.000,measure,1,85,40.900,79.647,62.400,205.0
    20.500,measure,0,92,41.200,79.647,62.400,205.0
    20.500,measure,1,92,40.900,79.647,62.400,205.0
    21.000,measure,0,84,41.200,79.647,62.400,205.0
    21.000,measure,1,84,40.900,79.647,62.400,205.0
    21.500,measure,0,4,23.500,79.647,62.400,310.0
    21.500,measure,1,4,23.100,79.647,62.400,310.0
    22.000,measure,0,6,23.500,79.647,62.400,310.0
    22.000,measure,1,10,23.100,79.647,62.400,310.0
    22.500,measure,0,1,23.500,79.647,62.400,310.0
    22.500,measure,1,3,23.100,79.647,62.400,310.0
    23.000,measure,0,82,31.800,79.647,62.400,260.0
    23.000,measure,1,82,31.200,79.647,62.400,260.0
    23.500,measure,0,82,31.800,79.647,62.400,260.0
    23.500,measure,1,85,31.200,79.647,62.400,260.0
    24.000,measure,0,65,31.800,79.647,62.400,260.0
    24.000,measure,1,64,31.200,79.647,62.400,260.0
    24.500,measure,0,74,31.800,79.647,62.400,260.0
    24.500,measure,1,74,31.200,79.647,62.400,260.0
    25.000,measure,0,57,31.800,79.647,62.400,260.0
    25.000,measure,1,54,31.200,79.647,62.400,260.0
    25.500,measure,0,0,18.400,79.647,63.100,1380.0
    25.500,measure,1,3,18.100,79.647,63.100,1380.0
    26.000,measure,0,2,18.400,79.647,63.100,1380.0
    26.000,measure,1,6,18.100,79.647,63.100,1380.0
    26.500,measure,0,4,18.400,79.647,63.100,1380.0
    26.500,measure,1,7,18.100,79.647,63.100,1380.0
""")

# a healthy ZeRO-2 colocated-vLLM step: busy, with a short dip for each weight sync
BUSY_CSV = textwrap.dedent("""\
    time_s,phase,gpu,util_pct,mem_used_gib,mem_total_gib,host_rss_gib,host_cpu_pct
    10.000,measure,0,91,70.100,79.647,12.000,101.0
    10.500,measure,0,94,70.100,79.647,12.000,101.0
    11.000,measure,0,95,70.100,79.647,12.000,101.0
    11.500,measure,0,93,70.100,79.647,12.000,101.0
    12.000,measure,0,22,70.100,79.647,12.000,101.0
    12.500,measure,0,18,70.100,79.647,12.000,101.0
    13.000,measure,0,96,70.100,79.647,12.000,101.0
    13.500,measure,0,97,70.100,79.647,12.000,101.0
    14.000,measure,0,95,70.100,79.647,12.000,101.0
    14.500,measure,0,92,70.100,79.647,12.000,101.0
    15.000,measure,0,94,70.100,79.647,12.000,101.0
    15.500,measure,0,90,70.100,79.647,12.000,101.0
    16.000,measure,0,93,70.100,79.647,12.000,101.0
    16.500,measure,0,95,70.100,79.647,12.000,101.0
    17.000,measure,0,96,70.100,79.647,12.000,101.0
    17.500,measure,0,21,70.100,79.647,12.000,101.0
    18.000,measure,0,25,70.100,79.647,12.000,101.0
    18.500,measure,0,94,70.100,79.647,12.000,101.0
    19.000,measure,0,92,70.100,79.647,12.000,101.0
    19.500,measure,0,97,70.100,79.647,12.000,101.0
    20.000,measure,0,95,70.100,79.647,12.000,101.0
    20.500,measure,0,93,70.100,79.647,12.000,101.0
    21.000,measure,0,91,70.100,79.647,12.000,101.0
    21.500,measure,0,96,70.100,79.647,12.000,101.0
""")

SWIFT_004 = {
    "zero_stage": 3,
    "offload": "optimizer+params",
    "offload_model": True,
    "offload_optimizer": True,
    "move_model_batches": 16,
    "sleep_level": 1,
    "use_vllm": True,
    "vllm_gpu_memory_utilization": 0.5,
    "per_device_train_batch_size": 2,
}

# --- real TRL trials on CPU, launched as the controller launches them ---------------------------

PROMPT, COMPLETION = 32, 16


def run_trial(recipe_factory, tmp_path, params, model="tiny-qwen", **recipe_kw):
    """Prepare and launch one trial to its end; returns (result, trial_dir, metrics lines)."""
    from autotune.candidate.space_file import load_space
    from autotune.hardware import find_gpu_type
    from autotune.models import resolve_model
    from autotune.runners.base import TrialContext
    from autotune.runners.trl import TrlRunner
    from autotune.trial.launch import launch

    base = dict(
        model=model,
        gpus=1,
        runner="trl",
        device="cpu",
        max_prompt_length=PROMPT,
        max_completion_length=COMPLETION,
        warmup_steps=1,
        measure_steps=1,
    )
    base.update(recipe_kw)
    recipe = recipe_factory(**base)
    context = TrialContext(
        recipe=recipe,
        space=load_space(),
        model=resolve_model(recipe.model),
        gpu=find_gpu_type(recipe.gpu_type),
    )
    runner = TrlRunner(context)
    runner.check()
    assert all(rule(params) is None for rule in runner.rules())
    trial_dir = tmp_path / "trial"
    spec = runner.prepare(params, trial_dir, 0)
    result = launch(
        spec,
        on_line=lambda stream, line: None,
        should_stop=lambda: None,
        trial_timeout_s=240,
        hang_timeout_s=120,
        grace_s=5,
    )
    metrics_file = trial_dir / "metrics.jsonl"
    lines = (
        [json.loads(text) for text in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    )
    return result, trial_dir, lines


#: A 7B-class TRL candidate the memory, planner, restart and export tests start from: ZeRO-3, checkpointing,
#: micro-batch 4 x 4 accumulation, 8 generations, vLLM colocated at 0.4 without sleep mode.
COLOCATED = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    num_generations=8,
    zero_stage=3,
    offload="none",
    gradient_checkpointing=True,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.4,
    vllm_enable_sleep_mode=False,
    vllm_tensor_parallel_size=1,
)


def params(pd=2, accum=2, gens=2, **kw):
    return dict(
        per_device_train_batch_size=pd,
        gradient_accumulation_steps=accum,
        num_generations=gens,
        gradient_checkpointing=True,
        use_vllm=False,
        zero_stage=0,
        offload="none",
        **kw,
    )


# a quick sim search (the faults tests make real studies with it)
SIM = [
    "search",
    "--model",
    "Qwen2.5-7B-Instruct",
    "--gpus",
    "4",
    "--runner",
    "sim",
    "--gpu-type",
    "A100-80GB",
    "--sim-time-scale",
    "0.0005",
    "--confirm",
    "0",
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a digest of its bytes: what 'nothing changed' means."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def swift_program() -> Path:
    venv = Path(os.environ.get("AUTOTUNE_SWIFT_VENV") or Path.home() / ".cache" / "autotune" / "swift-venv")
    candidate = Path(os.environ.get("AUTOTUNE_SWIFT_BIN") or venv / "bin" / "swift")
    if not candidate.is_file():
        if os.environ.get("AUTOTUNE_REQUIRE_SWIFT") == "1":
            pytest.fail(
                f"AUTOTUNE_REQUIRE_SWIFT=1 but no ms-swift at {candidate}: run bash scripts/swift_env.sh"
            )
        pytest.skip(
            f"no ms-swift at {candidate} (bash scripts/swift_env.sh makes it; AUTOTUNE_SWIFT_BIN names another)"
        )
    return candidate


# --- trainer scripts run as real trials (test_faults_logs, test_faults_decisive) ----------------

SCRIPT_PARAMS = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4, "num_generations": 4}

# Real texts (test_faults_logs.py's docstring says where each came from).
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total "
    "capacity of 79.18 GiB of which 20.19 MiB is free. Including non-PyTorch memory, this process has "
    "79.15 GiB memory in use. Of the allocated memory 76.18 GiB is allocated by PyTorch, and 2.21 GiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
RANK0_TRACEBACK = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/workspace/train_grpo.py", line 91, in <module>',
    "[rank0]:     trainer.train()",
    '[rank0]:   File "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1784, in _call_impl',
    "[rank0]:     return forward_call(*args, **kwargs)",
    "[rank0]: " + CUDA_OOM,
]
TEARDOWN = [  # what the other ranks and torchrun print while the job comes down
    "[rank{r}]:[W1122 05:50:37.{n:06d} 67{r}7 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1476] Warning: "
    "WARNING: destroy_process_group() was not called before program exit, which can leak resources. For more "
    "info, please see https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())",
    "W1122 05:50:37.{n:06d} 6749 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 67{r}7 "
    "closing signal SIGTERM",
    "[rank{r}]:[E1122 05:50:37.{n:06d} 67{r}7 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1595] [PG ID 0 "
    "PG GUID 0(default_pg) Rank {r}] Process group watchdog thread terminated with exception: NCCL error: remote "
    "process exited or there was a network error, NCCL version 2.21.5",
]
CHILD_FAILED = """\
E1122 05:50:37.642000 6749 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 6756) of binary: /opt/venv/bin/python3
Traceback (most recent call last):
  File "/opt/venv/bin/torchrun", line 6, in <module>
    sys.exit(main())
             ^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train_grpo.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_05:50:37
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 6757)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 6757
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:50:37
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 6756) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def noise(lines: int) -> list[str]:
    return [TEARDOWN[i % len(TEARDOWN)].format(r=1 + i % 7, n=i) for i in range(lines)]


def trainer(
    stderr: list[str],
    *,
    stdout: list[str] = (),
    exit_code: int = 1,
    metrics: list[dict] = (),
    sleep_s: float = 0.0,
    abort: bool = False,
) -> str:
    """A Python script that writes these metrics lines and log lines, then exits with ``exit_code``
    (or, with ``abort``, dies of SIGABRT as a C++ runtime's ``terminate`` does)."""
    return textwrap.dedent(f"""\
        import json, os, sys, time
        with open(os.environ["AUTOTUNE_METRICS_FILE"], "a") as out:
            for d in {list(metrics)!r}:
                out.write(json.dumps(d) + "\\n")
        for line in {list(stdout)!r}:
            print(line)
        sys.stdout.flush()
        for line in {list(stderr)!r}:
            print(line, file=sys.stderr)
        sys.stderr.flush()
        time.sleep({sleep_s!r})
        os.abort() if {abort!r} else sys.exit({exit_code})
        """)


def run_script_trial(tmp_path: Path, script: str, *, timeout_s: float = 60.0, name: str = "0"):
    """One trial through the real execute(): its own process group, logs teed to files, judged."""
    from autotune.recipe import Recipe
    from autotune.trial.control import StopRule, TrialControl
    from autotune.trial.execute import execute
    from autotune.trial.launch import LaunchSpec
    from autotune.trial.outcome import Outcome

    trial_dir = tmp_path / "trials" / name
    trial_dir.mkdir(parents=True)
    (tmp_path / f"trainer{name}.py").write_text(script)
    recipe = Recipe(
        model="Qwen2.5-0.5B",
        gpus=1,
        gpu_type="A10G",
        device="cpu",
        trial_timeout_s=timeout_s,
        hang_timeout_s=60.0,
    )
    spec = LaunchSpec(
        argv=[sys.executable, str(tmp_path / f"trainer{name}.py")],
        trial_dir=trial_dir,
        env={
            "AUTOTUNE_TRIAL_DIR": str(trial_dir),
            "PYTHONUNBUFFERED": "1",
            "AUTOTUNE_METRICS_FILE": str(trial_dir / "metrics.jsonl"),
        },
    )
    outcome = execute(
        spec,
        SCRIPT_PARAMS,
        recipe,
        TrialControl(StopRule.searching(recipe)),
        monitors_gpus=False,
        services=contextlib.nullcontext(),
    )
    assert Outcome.read(trial_dir / "outcome.json").status == outcome.status
    return outcome


# --- a search on the simulator, in-process (the search's own tests) ----------------------------

#: pins that leave the micro-batch (and what the test frees) to search: a small, lean grid
LEAN = {
    "zero_stage": 3,
    "offload": "optimizer+params",
    "gradient_checkpointing": True,
    "use_vllm": False,
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
}


def make_search(tmp_path, model="Qwen3-8B", gpus=8, gpu_name="RTX-4090", execute=None, **kw):
    """A Search on the simulator's runner (or ``execute``), its study in memory, no report."""
    import optuna

    from autotune.candidate.space_file import load_space
    from autotune.hardware import find_gpu_type
    from autotune.models import resolve_model
    from autotune.progress import Reporter
    from autotune.recipe import Recipe
    from autotune.runners import TrialContext
    from autotune.search.loop import Search
    from autotune.study import StudyPaths

    gpu = find_gpu_type(gpu_name)
    recipe = Recipe(
        model=model, gpus=gpus, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib, runner="sim", name="r", **kw
    )
    context = TrialContext(recipe, load_space(), resolve_model(recipe.model), gpu)
    return Search(
        recipe,
        StudyPaths(tmp_path, "r"),
        context,
        Reporter(recipe.trials),
        execute=execute,
        storage=optuna.storages.InMemoryStorage(),
        report=False,
    )
