import os
import sys
from pathlib import Path

import pytest

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
