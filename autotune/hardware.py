"""What the trials run on: GPU type, count and memory per GPU.

NVML is the source of truth when GPUs are visible; ``--gpu-type`` / ``--gpu-memory`` describe
hardware that is not visible here (rehearsing with the simulator, or planning for a cluster).
The table holds published figures (dense bf16 TFLOP/s, memory, HBM bandwidth, GPU-GPU link).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from autotune.errors import UsageError
from autotune.nvml import QUERY_ERRORS, close_nvml, open_nvml
from autotune.units import GIB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuType:
    """One GPU model. ``memory_gib`` is the usable capacity as NVML reports it, in GiB."""

    name: str
    memory_gib: float
    tflops_bf16: float
    bandwidth_tbs: float
    interconnect_gbs: float

    def to_json(self) -> dict:
        return asdict(self)


# Marketing "80 GB" cards report about 79.3 GiB through NVML; use what a process can see.
GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("A100-40GB", 39.4, 312, 1.56, 300),
        GpuType("A100-80GB", 79.3, 312, 2.04, 300),
        GpuType("H100-80GB", 79.3, 989, 3.35, 450),
        GpuType("H100-PCIe", 79.3, 756, 2.0, 64),
        GpuType("H200", 139.8, 989, 4.8, 450),
        GpuType("H20", 95.0, 148, 4.0, 450),
        GpuType("L40S", 44.5, 362, 0.86, 32),
        GpuType("A10G", 22.0, 125, 0.6, 32),
        GpuType("L4", 22.0, 121, 0.3, 32),
        GpuType("RTX-4090", 23.6, 165, 1.0, 32),
        GpuType("RTX-3090", 23.6, 71, 0.94, 32),
        GpuType("V100-32GB", 31.7, 125, 0.9, 150),
    )
}


# A GPU the table does not know: memory is what was measured or given; the rest are middling
# figures (dense bf16 TFLOP/s, HBM TB/s, GPU-GPU GB/s as over PCIe) the speed prior can rank with.
UNKNOWN_TFLOPS_BF16 = 100.0
UNKNOWN_BANDWIDTH_TBS = 1.0
UNKNOWN_INTERCONNECT_GBS = 32


def unlisted_gpu(name: str, memory_gib: float) -> GpuType:
    """A GPU type outside :data:`GPU_TYPES`, known only by its memory."""
    return GpuType(name, memory_gib, UNKNOWN_TFLOPS_BF16, UNKNOWN_BANDWIDTH_TBS, UNKNOWN_INTERCONNECT_GBS)


def find_gpu_type(name: str) -> GpuType:
    """Look a GPU type up by name, forgiving case and separators (``a100-80gb``, ``A100_80GB``)."""
    key = name.replace("_", "-").replace(" ", "-").lower()
    for gname, gpu in GPU_TYPES.items():
        if gname.lower() == key or gname.lower().replace("-", "") == key.replace("-", ""):
            return gpu
    raise UsageError(
        f"unknown GPU type '{name}': use one of {', '.join(GPU_TYPES)}, or give --gpu-memory GIB"
    )


def gpu_type_from_nvml_name(name: str, memory_gib: float) -> GpuType:
    """Map an NVML device name (``NVIDIA A100-SXM4-80GB``) to the table, or make an entry."""
    lowered = name.lower()
    for key, gpu in GPU_TYPES.items():
        stem = key.split("-")[0].lower()
        if stem in lowered and abs(gpu.memory_gib - memory_gib) < 0.15 * gpu.memory_gib:
            return replace(gpu, memory_gib=memory_gib)
    return unlisted_gpu(name, memory_gib)


@dataclass(frozen=True)
class VisibleGpu:
    index: int
    name: str
    memory_gib: float


def visible_gpus() -> list[VisibleGpu]:
    """GPUs NVML can see (respecting CUDA_VISIBLE_DEVICES is the caller's job); [] without NVML."""
    nvml = open_nvml(None, without="no GPU listed", level=logging.DEBUG)
    if nvml is None:
        return []
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(VisibleGpu(i, name, mem.total / GIB))
        return gpus
    finally:
        close_nvml(nvml)


def resolve_hardware(
    gpus: int, gpu_type: str | None, gpu_memory: float | None, *, need_visible: bool
) -> GpuType:
    """Decide what one GPU is for this search.

    ``need_visible`` is true for runners that really launch on GPUs (trl on cuda, command): then
    the count must not exceed what NVML sees, and NVML's description wins unless the user said
    otherwise. The simulator and CPU trials need only a description.
    """
    if gpus < 1:
        raise UsageError("--gpus must be at least 1")
    visible = visible_gpus() if need_visible or gpu_type is None else []
    if need_visible and visible and gpus > len(visible):
        raise UsageError(f"--gpus {gpus} but only {len(visible)} GPU(s) are visible: lower --gpus")
    if gpu_type or visible:
        gpu = (
            find_gpu_type(gpu_type)
            if gpu_type
            else gpu_type_from_nvml_name(visible[0].name, visible[0].memory_gib)
        )
        return replace(gpu, memory_gib=float(gpu_memory)) if gpu_memory else gpu
    if gpu_memory:
        return unlisted_gpu(f"custom-{gpu_memory:g}GiB", float(gpu_memory))
    raise UsageError(
        "no GPU is visible: describe the hardware with --gpu-type "
        f"({', '.join(GPU_TYPES)}) or --gpu-memory GIB"
    )


# NVML's topology levels between two GPUs (nvmlDeviceGetTopologyCommonAncestor): the lower, the
# closer. 40 is "same NUMA node", 50 "across sockets". NVLink (P2P over NVLink) counts as 0.
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
FAR = 60  # no topology information: every pair equally far


def link_distances(indices: list[int], nvml: Any | None = None) -> dict[tuple[int, int], int] | None:
    """How far apart each pair of GPUs is (0 NVLink, else NVML's common-ancestor level), or None
    when NVML cannot tell (no driver, a simulator rehearsal, an old binding)."""
    nvml = open_nvml(nvml, without="no GPU topology", level=logging.DEBUG)
    if nvml is None:
        return None
    try:
        try:
            handle = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        except QUERY_ERRORS as exc:
            log.debug("NVML topology query failed: %s", exc)
            return None
        far: dict[tuple[int, int], int] = {}
        for a in indices:
            for b in indices:
                if a < b:
                    far[(a, b)] = far[(b, a)] = _pair_level(nvml, handle[a], handle[b])
        return far
    finally:
        close_nvml(nvml)


def _pair_level(nvml: Any, a: Any, b: Any) -> int:
    """0 over NVLink, else NVML's common-ancestor level; :data:`FAR` when NVML cannot say."""
    try:
        if nvml.nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK) == NVML_P2P_STATUS_OK:
            return 0
    except QUERY_ERRORS:
        pass  # no NVLink answer: the common ancestor still tells NUMA from sockets
    try:
        return int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
    except QUERY_ERRORS:
        return FAR


def gpu_subsets(
    devices: list[int], size: int, count: int, distances: dict[tuple[int, int], int] | None = None
) -> list[list[int]]:
    """``count`` disjoint sets of ``size`` GPUs out of ``devices``, closest-linked first.

    A multi-GPU trial spends its step in all-reduce and (ZeRO-3) all-gather, so its GPUs should
    share NVLink, or at least a NUMA node; a set that straddles sockets runs slower than the same
    configuration will in production, and would be measured unfairly. Greedy: each set starts at
    the lowest free GPU and adds the free GPU whose farthest link to the set is the shortest
    (ties: lowest index). Without topology the sets are consecutive indices."""
    free = list(devices)
    subsets: list[list[int]] = []
    for _ in range(count):
        if len(free) < size:
            break
        group = [free.pop(0)]
        while len(group) < size:

            def cost(g: int, group: list[int] = group) -> tuple[int, int]:
                worst = max((distances or {}).get((g, m), 0) for m in group)
                return worst, g

            best = min(free, key=cost)
            free.remove(best)
            group.append(best)
        subsets.append(sorted(group))
    return subsets


def node_devices(node_gpus: int | None, *, need_visible: bool) -> list[int]:
    """The GPU indices this node offers to trials. Real GPUs: ``CUDA_VISIBLE_DEVICES`` when set, else
    NVML's, the first ``--node-gpus`` of them when given. A rehearsal (the simulator, ``--gpu-type``
    without GPUs): the node ``--node-gpus`` declares, or none known. Where neither the environment
    nor NVML can see the GPUs (a container without NVML), ``--node-gpus`` declares the node too: the
    user said how many there are, and every runner is told which of them to use."""
    if not need_visible:
        return list(range(node_gpus)) if node_gpus else []
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_env is not None and visible_env.strip():
        devices = [int(d) for d in visible_env.split(",") if d.strip().isdigit()]
    else:
        devices = list(range(len(visible_gpus())))
    if not devices and node_gpus:
        return list(range(node_gpus))
    return devices[:node_gpus] if node_gpus else devices


def plan_slots(
    gpus: int, parallel: int | None, node_gpus: int | None, *, need_visible: bool, nvml: Any | None = None
) -> list[list[int] | None]:
    """The disjoint GPU sets trials run on at once (one per slot), checked against the node.

    Without a node description (no NVML, no ``--node-gpus``) there is one slot, ``None``: the
    runner's default GPUs (the first N of ``CUDA_VISIBLE_DEVICES``, which may be UUIDs, or 0..N-1)."""
    if node_gpus is not None and node_gpus < gpus:
        raise UsageError(
            f"--node-gpus {node_gpus} is smaller than --gpus {gpus}: a trial needs {gpus} GPUs "
            f"of one node; raise --node-gpus or lower --gpus"
        )
    devices = node_devices(node_gpus, need_visible=need_visible)
    if not devices:
        if parallel is not None and parallel > 1:
            raise UsageError(
                f"--parallel {parallel} needs {parallel * gpus} GPUs but the node's are unknown: "
                f"give --node-gpus M (the GPUs of this node)"
            )
        if parallel is not None and parallel < 1:
            raise UsageError("--parallel must be at least 1")
        return [None]
    most = len(devices) // gpus
    if most < 1:
        raise UsageError(f"--gpus {gpus} but this node has {len(devices)} GPU(s): lower --gpus")
    if parallel is not None and parallel > most:
        raise UsageError(
            f"--parallel {parallel} needs {parallel * gpus} GPUs for --gpus {gpus} but the node has "
            f"{len(devices)}: use --parallel {most} or less"
        )
    if parallel is not None and parallel < 1:
        raise UsageError("--parallel must be at least 1")
    count = parallel or most
    wants_links = gpus > 1 and (need_visible or nvml is not None)
    distances = link_distances(devices, nvml) if wants_links else None
    return list(gpu_subsets(devices, gpus, count, distances))
