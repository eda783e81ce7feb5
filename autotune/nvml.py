"""NVML access that degrades instead of failing: the one module that imports pynvml.

Why one module: the GPU list and topology (:mod:`autotune.hardware`), the doctor, the trial's
sampling (:mod:`autotune.trial.telemetry`) and the cleanup between trials
(:mod:`autotune.trial.cleanup`) all need NVML, and each opened, closed and excused it its own way.

Everything NVML is reached through an object with pynvml's API (the real ``pynvml`` module from
nvidia-ml-py by default; tests inject a replay of recorded samples). When NVML cannot be initialised
(no driver, no GPU, CI, ``--device cpu``) the callers carry on without GPU figures; nothing here
raises because a GPU is missing.

GPU indices are NVML indices (as ``nvidia-smi`` numbers them, PCI bus order). They equal CUDA's
indices when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or on machines whose GPUs are all alike, which is the
usual training box; NVML ignores ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.units import MIB

log = logging.getLogger(__name__)

__all__ = [
    "NVMLError",
    "QUERY_ERRORS",
    "open_nvml",
    "close_nvml",
    "handles",
    "memory_used_mib",
    "driver_version",
]

try:
    from pynvml import NVMLError
except ImportError:  # nvidia-ml-py missing: open_nvml says so, and nothing can raise its errors

    class NVMLError(Exception):  # type: ignore[no-redef]
        """Stands in for pynvml's error class where nvidia-ml-py is not installed."""


# what one NVML query may raise: NVMLError subclasses (NotSupported on MIG slices, GpuIsLost, a
# symbol the driver lacks), OSError from ctypes, AttributeError from bindings older than the call
QUERY_ERRORS: tuple[type[BaseException], ...] = (NVMLError, OSError, AttributeError)


def open_nvml(
    nvml: Any | None, *, without: str = "GPU sampling off, host sampling only", level: int = logging.INFO
) -> Any | None:
    """Initialise NVML and return the module-like object, or None when NVML is not usable.

    Any NVML failure (:data:`QUERY_ERRORS`) counts as "no NVML": the real pynvml raises
    ``NVMLError_LibraryNotFound`` without a driver, ``NVMLError_DriverNotLoaded`` when the kernel
    module is missing, and an old driver may lack a symbol. Monitoring must degrade, never stop a
    search, so the reason is logged once and psutil carries on alone. ``without`` says what the
    caller does without NVML, logged at ``level``.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError as exc:
            log.log(level, "NVML not available (%s): %s", exc, without)
            return None
    try:
        nvml.nvmlInit()
    except QUERY_ERRORS as exc:
        log.log(level, "NVML could not be initialised (%s: %s): %s", type(exc).__name__, exc, without)
        return None
    return nvml


def close_nvml(nvml: Any | None) -> None:
    """Balance ``nvmlInit``: NVML counts initialisations, and each must be shut down once."""
    if nvml is None:
        return
    try:
        nvml.nvmlShutdown()
    except QUERY_ERRORS as exc:
        log.debug("nvmlShutdown failed: %s", exc)


def handles(nvml: Any, gpu_indices: Sequence[int] | None) -> dict[int, Any]:
    """NVML handles of the watched GPUs (all of them when ``gpu_indices`` is None).

    An index the machine does not have is dropped with a warning instead of failing: a recipe
    written for 8 GPUs replayed on a 4-GPU box should still be monitored on the 4 it has.
    """
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except QUERY_ERRORS as exc:
        log.warning("nvmlDeviceGetCount failed (%s): GPU sampling off", exc)
        return {}
    wanted = list(range(count)) if gpu_indices is None else list(gpu_indices)
    out: dict[int, Any] = {}
    for index in wanted:
        if not 0 <= index < count:
            log.warning("GPU %s is not on this machine (NVML sees %d): not monitored", index, count)
            continue
        try:
            out[index] = nvml.nvmlDeviceGetHandleByIndex(index)
        except QUERY_ERRORS as exc:
            log.warning("no NVML handle for GPU %s (%s): not monitored", index, exc)
    return out


def memory_used_mib(nvml: Any, gpu_handles: Mapping[int, Any]) -> dict[int, float]:
    """Device memory in use per GPU, MiB; a GPU whose query fails is left out."""
    used: dict[int, float] = {}
    for index, handle in gpu_handles.items():
        try:
            used[index] = nvml.nvmlDeviceGetMemoryInfo(handle).used / MIB
        except QUERY_ERRORS as exc:
            log.debug("nvmlDeviceGetMemoryInfo(%s) failed: %s", index, exc)
    return used


def driver_version() -> str:
    """The NVIDIA driver's version for ``autotune doctor``, or ``unavailable (<error class>)``."""
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception as exc:  # the doctor reports whatever is wrong; it never fails because of it
        return f"unavailable ({exc.__class__.__name__})"
    return driver.decode() if isinstance(driver, bytes) else driver
