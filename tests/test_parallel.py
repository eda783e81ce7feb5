"""Parallel trials on one node: disjoint GPU sets, chosen by topology, busy at once, judged apart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import optuna
import pytest
from conftest import run_cli

from autotune.errors import UsageError

SIM = [
    "search",
    "--model",
    "Qwen2.5-7B-Instruct",
    "--gpus",
    "2",
    "--gpu-type",
    "A100-80GB",
    "--runner",
    "sim",
]


class TopologyNvml:
    """pynvml's topology calls over a described machine: NVLink pairs and NUMA nodes."""

    def __init__(self, count: int, nvlink: set[frozenset[int]], numa: dict[int, int]) -> None:
        self.count, self.nvlink, self.numa = count, nvlink, numa
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, caps: int) -> int:
        assert caps == 2  # NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if frozenset((a, b)) in self.nvlink else 4  # OK / NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 40 if self.numa[a] == self.numa[b] else 50  # NODE / SYSTEM


def test_gpu_sets_follow_nvlink(monkeypatch):
    """NVLink joins 0-4, 1-5, 2-6, 3-7 (not neighbours by index): each 2-GPU trial gets a linked pair."""
    from autotune.hardware import plan_slots

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    nvml = TopologyNvml(8, {frozenset((i, i + 4)) for i in range(4)}, {i: i // 4 for i in range(8)})
    assert plan_slots(2, None, None, need_visible=True, nvml=nvml) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert nvml.inits == nvml.shutdowns == 1


def test_gpu_sets_stay_within_a_numa_node(monkeypatch):
    """No NVLink; GPUs listed interleaved across two sockets: a 4-GPU trial gets one socket's four."""
    from autotune.hardware import plan_slots

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,4,1,5,2,6,3,7")
    nvml = TopologyNvml(8, set(), {i: i // 4 for i in range(8)})
    assert plan_slots(4, None, None, need_visible=True, nvml=nvml) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan_slots(4, 1, None, need_visible=True, nvml=nvml) == [[0, 1, 2, 3]]


def test_without_topology_sets_are_consecutive():
    from autotune.hardware import plan_slots

    assert plan_slots(2, None, 8, need_visible=False) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan_slots(3, None, 8, need_visible=False) == [[0, 1, 2], [3, 4, 5]]
    assert plan_slots(2, None, None, need_visible=False) == [None]  # no node known: one default slot


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--node-gpus", "8", "--parallel", "5"], "--parallel 5 needs 10 GPUs"),
        (["--node-gpus", "1"], "--node-gpus 1 is smaller than --gpus 2"),
        (["--parallel", "3"], "give --node-gpus"),
        (["--node-gpus", "8", "--parallel", "0"], "--parallel must be at least 1"),
    ],
)
def test_bad_parallel_flags_are_one_line(tmp_path, flags, words):
    r = run_cli(*SIM, "--trials", "2", *flags, "--name", "bad", "--runs-dir", tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert not (tmp_path / "bad").exists()


def _interval(trial_dir: Path) -> tuple[float, float]:
    return (trial_dir / "command.txt").stat().st_mtime, (trial_dir / "outcome.json").stat().st_mtime


@pytest.mark.slow
def test_four_trials_at_once_on_disjoint_gpus(tmp_path):
    """8 simulated GPUs, 2 per trial: trials overlap in time, never on the same GPUs, each verdict
    is its own configuration's, and no configuration is measured twice."""
    from autotune.sim.landscape import evaluate

    r = run_cli(
        *SIM,
        "--trials",
        "10",
        "--node-gpus",
        "8",
        "--sim-time-scale",
        "0.003",
        "--confirm",
        "1",
        "--name",
        "par",
        "--runs-dir",
        tmp_path,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    root = tmp_path / "par"
    study = optuna.load_study(study_name="par", storage=f"sqlite:///{root / 'study.db'}")
    launched = [t for t in study.get_trials() if t.user_attrs.get("launched")]
    assert len(launched) == 10
    keys = [t.user_attrs["key"] for t in launched]
    assert len(set(keys)) == len(keys), "a configuration was measured twice"
    sets, spans = {}, {}
    for t in launched:
        d = root / "trials" / str(t.number)
        env = (d / "command.txt").read_text()
        visible = env.split("CUDA_VISIBLE_DEVICES=")[1].split()[0]
        sets[t.number] = frozenset(int(g) for g in visible.split(","))
        spans[t.number] = _interval(d)
        # the verdict is the configuration's own: the simulator's truth for exactly this spec
        # (a failure late in a long run may come after the trial was measured and stopped)
        truth = evaluate(json.loads((d / "sim_spec.json").read_text()))
        status = t.user_attrs["status"]
        if truth.failure is None:
            assert status == "ok", (t.number, status)
        if status == "oom":
            assert truth.failure is not None and t.user_attrs["oom_kind"] == truth.failure.kind, t.number
    assert set(sets.values()) <= {frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}), frozenset({6, 7})}
    overlapping = 0
    for a in spans:
        for b in spans:
            if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]:
                overlapping += 1
                assert sets[a] != sets[b], f"trials {a} and {b} ran at once on GPUs {sorted(sets[a])}"
    assert overlapping >= 3, "trials did not run at once"
    assert (root / "best" / "params.json").exists()


class BusyNodeNvml:
    """Four GPUs: 0 and 1 back at their baseline, 2 and 3 busy with another slot's trial."""

    def __init__(self) -> None:
        self.used_gib = {0: 0.5, 1: 0.5, 2: 60.0, 3: 61.0}
        self.listed: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        import pynvml

        total = 80 * 2**30
        used = int(self.used_gib[handle] * 2**30)
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        self.listed.append(handle)
        return []


def test_cleanup_and_leftovers_look_only_at_the_trials_own_gpus():
    """A trial on GPUs 0-1 ends while another slot's trial fills GPUs 2-3: its wait for the baseline
    returns at once, looks at no process on 2-3, and the next trial on 0-1 starts with no leftover."""
    from autotune.trial.cleanup import read_baseline, wait_for_baseline
    from autotune.trial.execute import leftover_gib

    nvml = BusyNodeNvml()
    baseline = read_baseline([0, 1], nvml=nvml)
    assert set(baseline) == {0, 1}
    started = time.monotonic()
    assert wait_for_baseline([0, 1], baseline, timeout_s=5, settle_s=1, nvml=nvml, poll_s=0.05)
    assert time.monotonic() - started < 1 and 2 not in nvml.listed and 3 not in nvml.listed
    assert leftover_gib([0, 1], baseline, nvml=nvml) is None
    nvml.used_gib[1] = 9.0  # now a real leftover on the trial's own GPU
    assert leftover_gib([0, 1], baseline, nvml=nvml) == pytest.approx(8.5, abs=0.01)


def test_node_gpus_declares_the_node_where_nvml_sees_nothing(monkeypatch):
    """`--parallel 2 --node-gpus 4 --command ...` on a machine without NVML: --node-gpus is the node."""
    from autotune import hardware

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hardware, "visible_gpus", lambda: [])
    assert hardware.plan_slots(2, 2, 4, need_visible=True) == [[0, 1], [2, 3]]
    assert hardware.plan_slots(2, None, 4, need_visible=True) == [[0, 1], [2, 3]]
    with pytest.raises(UsageError, match="give --node-gpus M"):  # nothing declared: still told what to give
        hardware.plan_slots(2, 2, None, need_visible=True)
