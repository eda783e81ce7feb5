"""What ms-swift's own environment can run: DeepSpeed, bitsandbytes, vLLM, asked of its interpreter.

The swift runner's trials run in ms-swift's venv, not in autotune's, so whether ``deepspeed`` is
importable here says nothing about a trial: ms-swift 4.6 imports DeepSpeed only when ``--deepspeed``
is given, and a venv without it fails every ZeRO trial at start with ``PackageNotFoundError: ...
'deepspeed' distribution was not found`` (three such crashes stop the search). So the packages are
looked up once per interpreter, in that interpreter, and the space is narrowed to what it can run,
with one log line per missing package naming the fix.
"""

from __future__ import annotations

import json
import logging
import subprocess
from typing import Any

from autotune.errors import UsageError

log = logging.getLogger(__name__)

#: The packages a swift trial may need beyond ms-swift itself, by the import name ms-swift uses.
OPTIONAL = ("deepspeed", "bitsandbytes", "vllm")
_FOUND: dict[str, dict[str, bool]] = {}
_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json, sys\n"
    "def have(name):\n"
    "    try:\n"
    "        m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        return False\n"
    "    return u.find_spec(name) is not None\n"
    "print(json.dumps({n: have(n) for n in sys.argv[1:]}))\n"
)


def capabilities(python: str) -> dict[str, bool]:
    """Which of :data:`OPTIONAL` ``python`` has installed (found and with its distribution's
    metadata, as ms-swift checks DeepSpeed's version through importlib.metadata); not imported:
    importing vllm or deepspeed takes seconds."""
    if python in _FOUND:
        return _FOUND[python]
    try:
        done = subprocess.run([python, "-c", _PROBE, *OPTIONAL], capture_output=True, text=True, timeout=120)
        found = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        found = None
    if not isinstance(found, dict):
        raise UsageError(
            f"cannot ask {python} which packages it has; rebuild it with bash scripts/swift_env.sh"
        )
    _FOUND[python] = {name: bool(found.get(name)) for name in OPTIONAL}
    return _FOUND[python]


FIX = "bash scripts/swift_env.sh installs it there"


def refuse_missing(python: str, quantization: str | None) -> None:
    """A ``--quantization`` that ms-swift's environment cannot load is refused: every trial would
    fail with "Using bitsandbytes 4-bit quantization requires bitsandbytes", and nothing is left
    to search without it."""
    if quantization and not capabilities(python)["bitsandbytes"]:
        raise UsageError(
            f"--quantization {quantization} with --runner swift: ms-swift's environment ({python}) has no "
            f"bitsandbytes; {FIX}, or leave --quantization out"
        )


def restrict(python: str, *, cpu: bool, processes: int = 1) -> dict[str, Any]:
    """The parameters to fix so that every candidate runs in ``python``'s environment, each fix
    said in one log line (as the TRL runner does for its own environment)."""
    have = capabilities(python)
    out: dict[str, Any] = {}
    if not cpu and not have["vllm"]:
        log.warning(
            "vllm is not installed for %s: searching without vLLM generation (pip install vllm there)", python
        )
        out["use_vllm"] = False
    if not have["deepspeed"]:
        log.warning("deepspeed is not installed for %s: searching ZeRO stage 0 only (%s)", python, FIX)
        out.update(zero_stage=0, offload="none")
    elif cpu and processes == 1:
        # one CPU process: ms-swift starts no torch.distributed launcher, and DeepSpeed's
        # init_distributed then looks for MPI ("No module named 'mpi4py'", three crashes in a row)
        log.warning(
            "ms-swift on CPU: searching ZeRO stage 0 only (DeepSpeed needs a distributed launch there)"
        )
        out.update(zero_stage=0, offload="none")
    return out
