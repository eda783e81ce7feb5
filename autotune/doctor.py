"""``autotune doctor``: what this machine has for real trials, and what is missing."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
from typing import Any

from autotune.hardware import link_distances, visible_gpus
from autotune.nvml import driver_version


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def report() -> dict[str, Any]:
    """A flat mapping, printable as lines or JSON."""
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    gpus = visible_gpus()
    out["gpus"] = (
        ", ".join(f"{g.index}: {g.name} {g.memory_gib:.1f} GiB" for g in gpus) or "none visible (NVML)"
    )
    out["driver"] = driver_version()
    for package in (
        "torch",
        "transformers",
        "trl",
        "accelerate",
        "datasets",
        "peft",
        "vllm",
        "deepspeed",
        "optuna",
        "nvidia-ml-py",
    ):
        out[package] = _version(package)
    if out["torch"] != "missing":
        try:
            torch = importlib.import_module("torch")
            out["torch cuda"] = f"{torch.version.cuda or 'cpu build'}; available={torch.cuda.is_available()}"
        except Exception as exc:
            out["torch cuda"] = f"import failed: {exc}"
    out["accelerate cli"] = shutil.which("accelerate") or "missing"
    out["postgres driver"] = next(
        (
            f"{p} {_version(v)}"
            for p, v in (("psycopg", "psycopg"), ("psycopg2", "psycopg2"), ("psycopg2", "psycopg2-binary"))
            if _version(v) != "missing"
        ),
        "missing",
    )
    if len(gpus) > 1:
        links = link_distances([g.index for g in gpus])
        if links is not None:
            nvlinked = sorted({tuple(sorted(pair)) for pair, level in links.items() if level == 0})
            out["nvlink pairs"] = ", ".join(f"{a}-{b}" for a, b in nvlinked) or "none (PCIe / NUMA only)"
    missing = [p for p in ("torch", "transformers", "trl", "accelerate", "datasets") if out[p] == "missing"]
    hints = []
    if missing:
        hints.append(f"real TRL trials need {', '.join(missing)}: pip install -e '.[trl]'")
    if out["vllm"] == "missing":
        hints.append(
            "no vllm: searches run without vLLM generation (pip install -e '.[vllm]' on a GPU machine)"
        )
    if out["deepspeed"] == "missing":
        hints.append(
            "no deepspeed: searches use ZeRO stage 0 without offload (pip install -e '.[deepspeed]')"
        )
    if not gpus:
        hints.append("no GPU: use --runner sim to rehearse, or --device cpu for real CPU trials")
    if out["postgres driver"] == "missing":
        hints.append(
            "no PostgreSQL driver: one study across several nodes needs pip install 'autotune[postgres]'"
        )
    out["next steps"] = "; ".join(hints) or "ready"
    return out
