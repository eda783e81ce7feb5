"""Telling failures apart: real error texts in, (status, oom_kind, error_line) out.

Fixtures under tests/data/logs are real or assembled from real message texts (see its README);
several cases below provoke the failure for real in a subprocess and classify what it printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.trial.classify import classify_failure, diagnose, last_error_line
from autotune.trial.outcome import OOM_KINDS, STATUSES, Outcome, describe

LOGS = Path(__file__).parent / "data" / "logs"


def log(name: str) -> str:
    return (LOGS / name).read_text(encoding="utf-8")


def run_python(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# Fixtures: one expectation per real failure text
# --------------------------------------------------------------------------------------------

CASES = [
    # file, returncode, status, oom_kind, text the error line must contain
    (  # captured on an H100: TRL 1.16's traceback, torch 2.11+cu130 (tests/data/logs/README.md)
        "h100_trl_cuda_oom.log",
        1,
        "oom",
        "cuda",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 216.00 MiB. GPU 0 has a total capacity of 79.18 GiB",
    ),
    (
        "cuda_oom_new_format.log",
        1,
        "oom",
        "cuda",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.14 GiB",
    ),
    (
        "cuda_oom_old_format.log",
        1,
        "oom",
        "cuda",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity",
    ),
    ("cuda_error_out_of_memory.log", 1, "oom", "cuda", "RuntimeError: CUDA error: out of memory"),
    (
        "cuda_error_out_of_memory_accelerator_error.log",
        1,
        "oom",
        "cuda",
        "torch.AcceleratorError: CUDA error: out of memory",
    ),
    (
        "cublas_alloc_failed.log",
        1,
        "oom",
        "cuda",
        "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    ),
    ("nccl_cuda_failure_oom.log", 1, "oom", "cuda", "NCCL WARN Cuda failure 'out of memory'"),
    (
        "vllm_cumem_sleep_oom.log",
        1,
        "oom",
        "cuda",
        "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:139",
    ),
    (
        "multirank_cuda_oom_then_nccl_watchdog.log",
        1,
        "oom",
        "cuda",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 130.00 MiB",
    ),
    (
        "vllm_kv_no_cache_blocks.log",
        1,
        "oom",
        "vllm_kv",
        "ValueError: No available memory for the cache blocks.",
    ),
    (
        "vllm_kv_cache_needed.log",
        1,
        "oom",
        "vllm_kv",
        "(24.00 GiB KV cache is needed, which is larger than the available KV cache memory (8.68 GiB)",
    ),
    (
        "vllm_kv_max_tokens_v0.log",
        1,
        "oom",
        "vllm_kv",
        "is larger than the maximum number of tokens that can be stored in KV cache (13456)",
    ),
    (
        "vllm_startup_free_memory.log",
        1,
        "oom",
        "vllm_startup",
        "Free memory on device cuda:0 (12.18/23.56 GiB) on startup is less than desired GPU memory utilization (0.92, 21.67 GiB)",
    ),
    (
        "torchrun_rank0_host_oom_gloo.log",
        1,
        "oom",
        "host",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 100000000000 bytes",
    ),
    ("pin_memory_host_oom.log", 1, "oom", "host", "RuntimeError: CUDA error: out of memory"),
    ("torchrun_rank1_sigkill.log", 1, "oom", "host", "Signal 9 (SIGKILL) received by PID"),
    ("accelerate_sigkill.log", 1, "oom", "host", "died with <Signals.SIGKILL: 9>"),
    ("torchrun_rank0_keyerror.log", 1, "crash", None, "KeyError: 'format'"),
    (
        "deepspeed_batch_assertion.log",
        1,
        "crash",
        None,
        "AssertionError: Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 16 != 2 * 4 * 1",
    ),
    ("harmless_warnings_then_crash.log", 1, "crash", None, "IndexError: list index out of range"),
    (
        "vllm_engine_wraps_config_error.log",
        1,
        "crash",
        None,
        "ValueError: User-specified max_model_len (65536) is greater than the derived max_model_len",
    ),
]


@pytest.mark.parametrize("name,rc,status,kind,needle", CASES, ids=[c[0] for c in CASES])
def test_real_failure_texts_are_classified(name, rc, status, kind, needle):
    got_status, got_kind, line = classify_failure(rc, log(name))
    assert (got_status, got_kind) == (status, kind), line
    assert line is not None and needle in line
    assert len(line) <= 300
    assert "\n" not in line


def test_every_fixture_is_covered():
    covered = {c[0] for c in CASES} | {
        "trl_grpo_cpu_merged.log",
        "swift_sft_iter_per_s.log",
        "swift_grpo_iter_per_s.log",
        "swift4_s_per_it_constructed.log",
        "h100_resumed_run_sigterm.log",  # test_real_sigterm_after_warnings_names_the_signal
    }
    assert {p.name for p in LOGS.glob("*.log")} == covered


# --------------------------------------------------------------------------------------------
# Real failures, provoked here
# --------------------------------------------------------------------------------------------


def test_real_host_oom_under_rlimit_is_host():
    proc = run_python(
        """
        import resource, torch
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))
        torch.empty(10**11, dtype=torch.uint8)
        """
    )
    assert proc.returncode == 1
    assert "DefaultCPUAllocator: can't allocate memory" in proc.stderr  # the real text, as torch prints it
    status, kind, line = classify_failure(proc.returncode, proc.stdout + proc.stderr)
    assert (status, kind) == ("oom", "host")
    assert line.startswith("RuntimeError: [enforce fail at alloc_cpu.cpp")
    assert "you tried to allocate 100000000000 bytes" in line


def test_real_python_memoryerror_is_host():
    proc = run_python(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1024**3, 1024**3))
        buffer = bytearray(4 * 1024**3)
        """
    )
    assert proc.returncode == 1
    assert classify_failure(proc.returncode, proc.stderr) == ("oom", "host", "MemoryError")


def test_real_sigkill_without_traceback_is_host():
    proc = run_python(
        """
        import os, signal
        print("{'loss': '0.01', 'step_time': '2.5', 'epoch': '0.01'}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert proc.returncode == -9 and proc.stderr == ""
    status, kind, line = classify_failure(proc.returncode, proc.stdout)
    assert (status, kind) == ("oom", "host")
    assert line == "killed by SIGKILL (exit code -9)"


def test_real_sigterm_after_warnings_names_the_signal():
    # the restart of that run, stopped by SIGTERM after its step: its last lines are transformers'
    # resume warnings (real text, replayed by a real process), which say nothing of why it ended
    text = log("h100_resumed_run_sigterm.log")
    proc = run_python(
        f"""
        import os, signal, sys
        sys.stderr.write({text!r})
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        """
    )
    assert proc.returncode == -15 and "trainer_state.json" in proc.stderr
    assert last_error_line(proc.stderr).startswith("per_device_train_batch_size: 16 (from args)")
    assert classify_failure(proc.returncode, proc.stderr) == (
        "crash",
        None,
        "ended by SIGTERM (exit code -15)",
    )
    # the launcher's own kill keeps the last line (where a hung trial stood)
    assert classify_failure(-15, proc.stderr, stopped_by_us=True)[2].startswith("per_device_train_batch_size")
    # an error text before the signal still names it, a consequence too: an NCCL watchdog's abort
    # (SIGABRT) keeps its DistBackendError line, which marks the crash as transient (search/transient.py)
    abort = "terminate called after throwing an instance of 'c10::DistBackendError'\n"
    assert "DistBackendError" in classify_failure(-6, proc.stderr + abort)[2]
    assert classify_failure(-15, proc.stderr + "ValueError: bad\n")[2] == "ValueError: bad"


def test_real_sigkill_through_a_shell_is_host():
    proc = subprocess.run(
        [
            "bash",
            "-c",
            f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'; exit $?",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 137
    assert " Killed " in proc.stderr  # bash: line 1:  1234 Killed  ...
    status, kind, line = classify_failure(proc.returncode, proc.stderr)
    assert (status, kind) == ("oom", "host")
    assert "Killed" in line


def test_real_plain_python_error_is_a_crash_with_its_exception_line():
    proc = run_python(
        """
        def reward(completions):
            return [len(c) / 0 for c in completions]
        reward(["a"])
        """
    )
    assert classify_failure(proc.returncode, proc.stderr) == (
        "crash",
        None,
        "ZeroDivisionError: division by zero",
    )


def test_real_trl_config_errors_are_invalid():
    """GRPOConfig's own refusals, raised for real, one traceback each."""
    pytest.importorskip("trl")
    proc = run_python(
        """
        import sys, tempfile, traceback
        from trl import GRPOConfig
        cases = [
            dict(per_device_train_batch_size=3, num_generations=2),
            dict(per_device_train_batch_size=4, num_generations=1),
            dict(per_device_train_batch_size=4, num_generations=2, generation_batch_size=6),
        ]
        for kwargs in cases:
            try:
                GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[], **kwargs)
            except ValueError:
                traceback.print_exc()
            print("=====", file=sys.stderr, flush=True)
        """
    )
    chunks = [c for c in proc.stderr.split("=====") if "Traceback" in c]
    assert len(chunks) == 3, proc.stderr[-2000:]
    results = [classify_failure(1, chunk) for chunk in chunks]
    assert [r[:2] for r in results] == [("invalid", None)] * 3
    assert results[0][2] == "ValueError: generation_batch_size (3) must be divisible by num_generations (2)."
    assert results[1][2].startswith("ValueError: GRPO requires at least 2 generations per prompt")
    assert (
        results[2][2]
        == "ValueError: generation_batch_size (6) must be divisible by the global batch size (4)."
    )


def test_vllm_tensor_parallel_refusal_is_invalid():
    # trl/generation/vllm_generation.py (colocate), same words in ms-swift's rollout_mixin.py
    text = (
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]: ValueError: tensor_parallel_size (2) must divide world size (3) evenly.\n"
        "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4210\n"
    )
    assert classify_failure(1, text) == (
        "invalid",
        None,
        "ValueError: tensor_parallel_size (2) must divide world size (3) evenly.",
    )


# --------------------------------------------------------------------------------------------
# Precedence and edge cases
# --------------------------------------------------------------------------------------------


def test_sigkill_with_an_error_of_its_own_is_a_crash():
    text = log("torchrun_rank0_keyerror.log").replace("exitcode  : 1 (pid", "exitcode  : -9 (pid")
    assert classify_failure(-9, text) == ("crash", None, "KeyError: 'format'")


def test_exit_codes_without_text():
    assert classify_failure(137, "") == ("oom", "host", "killed by SIGKILL (exit code 137)")
    assert classify_failure(1, "") == ("crash", None, None)
    assert classify_failure(None, "step 3\n") == ("crash", None, "step 3")
    assert classify_failure(-11, "Segmentation fault (core dumped)\n")[:2] == ("crash", None)


def test_our_own_kill_is_not_the_oom_killer():
    # the launcher SIGKILLed a hung or finished trial: the exit code says nothing about memory
    assert classify_failure(-9, "step 3\n", stopped_by_us=True) == ("crash", None, "step 3")
    # ... but a child's SIGKILL reported by torchrun still does
    assert classify_failure(-9, log("torchrun_rank1_sigkill.log"), stopped_by_us=True)[:2] == ("oom", "host")
    # and any OOM text wins either way
    assert classify_failure(-9, log("cuda_oom_new_format.log"), stopped_by_us=True)[:2] == ("oom", "cuda")


def test_the_earliest_memory_signal_is_the_root_cause():
    # vLLM could not start because the trainer had taken the memory; a later CUDA OOM elsewhere
    # is a consequence, not the reason.
    text = log("vllm_startup_free_memory.log") + "\n" + log("cuda_oom_new_format.log")
    assert classify_failure(1, text)[:2] == ("oom", "vllm_startup")
    text = log("cuda_oom_new_format.log") + "\n" + log("vllm_kv_no_cache_blocks.log")
    assert classify_failure(1, text)[:2] == ("oom", "cuda")


def test_an_oom_beats_the_crashes_it_causes():
    text = log("torchrun_rank0_keyerror.log").replace(
        "[rank0]: KeyError: 'format'",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total "
        "capacity of 14.57 GiB of which 1.58 GiB is free.",
    )
    status, kind, line = classify_failure(1, text)
    assert (status, kind) == ("oom", "cuda")
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB")


def test_oom_message_on_the_line_after_its_exception_name():
    # Seen in trl#3172: the exception name and its message on separate lines.
    text = (
        "    return t.to(\n"
        "torch.OutOfMemoryError:\n"
        "CUDA out of memory. Tried to allocate 130.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which 12.81 MiB is free.\n"
    )
    status, kind, line = classify_failure(1, text)
    assert (status, kind) == ("oom", "cuda")
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 130.00 MiB.")


def test_advice_about_memory_is_not_an_oom():
    text = (
        "WARNING 03-02 10:11:40 [config.py:1450] To reduce the chance of CUDA out of memory errors, lower gpu_memory_utilization.\n"
        "UserWarning: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation\n"
        "If you see std-out advice about MemoryError handling, ignore it\n"
        "ValueError: reward function returned 3 values for 4 completions\n"
    )
    assert classify_failure(1, text) == (
        "crash",
        None,
        "ValueError: reward function returned 3 values for 4 completions",
    )


def test_progress_bars_and_colours_do_not_hide_the_error():
    text = (
        "\r 25%|██▌       | 1/4 [00:41<02:04, 41.23s/it]"
        "\x1b[31m[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
        "GPU 0 has a total capacity of 79.14 GiB of which 3.12 MiB is free.\x1b[0m\n"
        "\r 25%|██▌       | 1/4 [00:41<02:04, 41.23s/it]\n"
    )
    status, kind, line = classify_failure(1, text)
    assert (status, kind) == ("oom", "cuda")
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.")


def test_other_host_memory_texts():
    cases = [
        "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\nAborted (core dumped)\n",
        "RuntimeError: DataLoader worker (pid 5123) is killed by signal: Killed. \n",
        "OSError: [Errno 12] Cannot allocate memory\n",
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n",
    ]
    for text in cases:
        assert classify_failure(1, text)[:2] == ("oom", "host"), text


def test_other_accelerator_memory_texts():
    cases = [
        "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED\n",
        "[rank7]: Cuda failure 2 'out of memory'\n",
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 191.98 GiB\n",
        "RuntimeError: MPS backend out of memory (MPS allocated: 17.96 GB, other allocations: 1.02 GB, max allowed: 18.13 GB).\n",
    ]
    for text in cases:
        assert classify_failure(1, text)[:2] == ("oom", "cuda"), text


def test_last_error_line_skips_consequences():
    # rank 1's "Connection closed by peer" and torchrun's ChildFailedError come after the real error
    assert last_error_line(log("torchrun_rank0_keyerror.log")) == "KeyError: 'format'"
    chained = (
        "Traceback (most recent call last):\n"
        "KeyError: 'prompt'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 9, in <module>\n'
        "datasets.exceptions.DatasetGenerationError: An error occurred while generating the dataset\n"
    )
    assert (
        last_error_line(chained)
        == "datasets.exceptions.DatasetGenerationError: An error occurred while generating the dataset"
    )
    only_consequences = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n======\n"
    assert (
        last_error_line(only_consequences)
        == "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
    )
    assert last_error_line("\n\n") is None
    long = "ValueError: " + "x" * 1000
    assert len(last_error_line(long)) == 300


def test_diagnose_gives_a_detail_line():
    d = diagnose(1, log("vllm_kv_no_cache_blocks.log"))
    assert d.status == "oom" and d.oom_kind == "vllm_kv" and "KV cache" in d.detail
    assert diagnose(-9, "").detail.startswith(describe("oom", "host"))
    for status in STATUSES:
        assert describe(status)
    for kind in OOM_KINDS:
        assert describe("oom", kind) != "oom"


# --------------------------------------------------------------------------------------------
# Outcome
# --------------------------------------------------------------------------------------------


def test_outcome_round_trip(tmp_path):
    outcome = Outcome(
        status="oom",
        oom_kind="cuda",
        peak_memory_gib=78.9,
        error_line="torch.OutOfMemoryError: CUDA out of memory.",
        steps=2,
        step_times=[41.2, 40.8],
        wall_time_s=312.5,
        returncode=1,
        detail=describe("oom", "cuda"),
        extra={"figures": {"tried_gib": 2.0}},
    )
    path = tmp_path / "trials" / "3" / "outcome.json"
    outcome.write(path)
    data = json.loads(path.read_text())
    # the fixed contract fields are always there, null when unknown
    for key in ("status", "oom_kind", "throughput", "peak_memory_gib", "mean_gpu_util", "error_line"):
        assert key in data
    assert data["throughput"] is None and data["mean_gpu_util"] is None
    assert path.read_text().startswith("{\n  ")  # pretty
    assert Outcome.read(path) == outcome
    assert [p.name for p in path.parent.iterdir()] == ["outcome.json"]  # no temp file left behind


def test_outcome_from_json_tolerates_other_writers():
    outcome = Outcome.from_json({"status": "ok", "throughput": 12.5, "gpu": "H100", "step_times": None})
    assert outcome.throughput == 12.5 and outcome.extra == {"gpu": "H100"} and outcome.step_times == []
    assert outcome.status == "ok" and outcome.oom_kind is None


def test_outcome_validates():
    with pytest.raises(ValueError):
        Outcome(status="exploded")
    with pytest.raises(ValueError):
        Outcome(status="oom", oom_kind="disk")
    with pytest.raises(ValueError):
        Outcome(status="crash", oom_kind="cuda")
    for status in STATUSES:
        assert Outcome(status=status).status == status
    for kind in OOM_KINDS:
        assert Outcome(status="oom", oom_kind=kind).oom_kind == kind


def test_outcome_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        Outcome(status="ok", throughput=float("nan")).write(tmp_path / "outcome.json")
    assert not (tmp_path / "outcome.json").exists()


def test_an_outcome_written_before_the_typed_fields_reads_into_them(tmp_path):
    """Studies written by the old code kept launched, pruned, predicted_gib and leftover_gib under
    ``extra``: resume, show and the report must still read them."""
    import json

    from autotune.trial.outcome import Status

    old = {
        "status": "ok",
        "throughput": 3.0,
        "extra": {
            "launched": True,
            "pruned": True,
            "predicted_gib": 41.5,
            "leftover_gib": 2.0,
            "monitor": {},
        },
    }
    (tmp_path / "outcome.json").write_text(json.dumps(old))
    got = Outcome.read(tmp_path / "outcome.json")
    assert got.launched and got.pruned and got.predicted_gib == 41.5 and got.leftover_gib == 2.0
    assert got.extra == {"monitor": {}} and got.status is Status.OK
    got.write(tmp_path / "again.json")  # the new file holds the plain strings and the fields at the top
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["status"] == "ok" and again["launched"] is True and "launched" not in again["extra"]
