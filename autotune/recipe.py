"""The recipe: what the user trains and how the search may run, saved with the study.

A recipe is everything ``autotune search`` was told. It is written to ``runs/<study>/recipe.yaml``
so that ``autotune resume <study>`` needs only the name, and so that re-using a study name with a
different training setup is caught instead of silently mixing incomparable trials.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import UsageError
from autotune.files import write_text
from autotune.units import duration_seconds

# Fields that change what a trial measures. Two recipes that differ here are different studies;
# the rest (trial count, budgets, timeouts) may change between `search` and `resume`.
IDENTITY_FIELDS = (
    "model",
    "gpus",
    "gpu_type",
    "gpu_memory_gib",
    "max_prompt_length",
    "max_completion_length",
    "global_batch",
    "pins",
    "space_digest",
    "runner",
    "command",
    "device",
    "memory_limit_gib",
    "beta",
    "lora_rank",
    "dataset",
    "storage",
    "quantization",
    "image_tokens",
    "images_per_prompt",
    "swift_args",
)


def _opt(
    help: str,
    *,
    flag: str | None = None,
    kind: str | None = None,
    commands: str = "search",
    resolved: bool = False,
) -> dict[str, Any]:
    """Field metadata the CLI derives its options from: the help text, the flag when it is not
    ``--field-name``, how the value is read (``duration``: '30m'), which commands take it
    (``search``, or ``recipe`` for the flags that describe the training run, shared with estimate),
    and whether the default is only a placeholder that is resolved later (the GPU from NVML)."""
    return {"help": help, "flag": flag, "kind": kind, "commands": commands, "resolved": resolved}


@dataclass
class Recipe:
    """What is trained and the rules of the search: the one place that documents every field
    and holds its default. The command line derives its options from these fields."""

    model: str = field(
        metadata=_opt(
            "Card name (Qwen2.5-7B-Instruct), HF cache id, or a directory with config.json.",
            commands="recipe",
        )
    )
    gpus: int = field(metadata=_opt("GPUs per trial (one node).", commands="recipe"))
    gpu_type: str = field(
        default="",
        metadata=_opt(
            "GPU model when not visible through NVML, e.g. A100-80GB.", commands="recipe", resolved=True
        ),
    )
    gpu_memory_gib: float = field(
        default=0.0,
        metadata=_opt(
            "Memory per GPU in GiB (overrides the type's).",
            flag="--gpu-memory",
            commands="recipe",
            resolved=True,
        ),
    )
    max_prompt_length: int = field(
        default=512, metadata=_opt("Prompt tokens every trial uses (the worst case).", commands="recipe")
    )
    max_completion_length: int = field(
        default=1024,
        metadata=_opt("Completion tokens every trial generates (the worst case).", commands="recipe"),
    )
    global_batch: int | None = field(
        default=None,
        metadata=_opt("Completions per optimizer step; accumulation is derived.", commands="recipe"),
    )
    pins: dict[str, Any] = field(
        default_factory=dict, metadata=_opt("Pin a parameter (repeatable).", flag="--set", commands="recipe")
    )
    space: str = field(
        default="",
        metadata=_opt(
            "Search-space YAML (default: search_spaces/grpo.yaml).", commands="recipe", resolved=True
        ),
    )
    space_digest: str = ""  # hash of the space file's contents, so an edited space is noticed
    runner: str = field(default="trl", metadata=_opt("What runs a trial: trl, swift, sim or command."))
    command: str | None = field(
        default=None,
        metadata=_opt("Trainer command template with {placeholders} (implies --runner command)."),
    )
    swift_bin: str | None = field(
        default=None, metadata=_opt("The swift program for --runner swift (default: swift on PATH).")
    )
    swift_args: str = field(
        default="", metadata=_opt('Extra flags passed to every swift rlhf trial, e.g. "--attn_impl sdpa".')
    )
    device: str = field(default="cuda", metadata=_opt("cuda, or cpu for real trials on the CPU."))
    memory_limit_gib: float | None = field(
        default=None,
        metadata=_opt("Cap each trial's address space at GIB (RLIMIT_AS).", flag="--memory-limit"),
    )
    beta: float = field(
        default=0.0, metadata=_opt("KL coefficient; > 0 loads a reference model.", commands="recipe")
    )
    lora_rank: int | None = field(
        default=None,
        metadata=_opt("Train LoRA adapters of this rank instead of all weights.", commands="recipe"),
    )
    quantization: str | None = field(
        default=None,
        metadata=_opt(
            "Load the base quantized with bitsandbytes: 4bit (NF4, QLoRA) or 8bit.", commands="recipe"
        ),
    )
    image_tokens: int = field(
        default=0,
        metadata=_opt("Vision-language: prompt tokens that come from each image.", commands="recipe"),
    )
    images_per_prompt: int = field(
        default=1, metadata=_opt("Vision-language: images in each prompt.", commands="recipe")
    )
    dataset: str | None = field(
        default=None,
        metadata=_opt(
            "Prompts for real trials, a JSONL file with a 'prompt' field (default: synthetic worst-case "
            "prompts of exactly --max-prompt-length tokens)."
        ),
    )
    train_script: str | None = None  # the user's training script, named in the exported launch.sh
    trials: int = field(
        default=30, metadata=_opt("Trials to launch (refused and repeated candidates are free).")
    )
    time_budget_s: float | None = field(
        default=None,
        metadata=_opt(
            "Stop launching when the next trial would pass it, e.g. 8h.",
            flag="--time-budget",
            kind="duration",
        ),
    )
    headroom: float = field(
        default=0.05, metadata=_opt("Memory fraction the exported config must leave free.")
    )
    confirm: int = field(
        default=3,
        metadata=_opt(
            "Leading candidates re-run longer before export (0: none); a runner-up's run out of "
            "reach of winning is stopped early and counts among them."
        ),
    )
    patience: int = field(
        default=10,
        metadata=_opt(
            "Stop once this many trials that ran (OOMs do not count) brought no gain beyond the "
            "noise (the larger of 3% and the spread of its own one-knob pairs the speed prior "
            "cannot tell apart), after at least 6 more launched, once each value of a switch "
            "neither the memory model nor the speed prior reads has run, and once vLLM's share, "
            "where the prior does not read it, is as high as the measured peak has room for, one "
            "value at a time where no peak is measured (0: never)."
        ),
    )
    warmup_steps: int = field(default=2, metadata=_opt("Steps before a trial's throughput is measured."))
    measure_steps: int = field(
        default=3,
        metadata=_opt(
            "Measured steps per trial (a stable one, or one out of reach of the best, stops sooner)."
        ),
    )
    trial_timeout_s: float = field(
        default=1800.0,
        metadata=_opt("Kill a trial at this wall time.", flag="--trial-timeout", kind="duration"),
    )
    hang_timeout_s: float = field(
        default=300.0,
        metadata=_opt("Kill a trial after this long without output.", flag="--hang-timeout", kind="duration"),
    )
    min_util: float = field(
        default=0.5,
        metadata=_opt("Mean GPU utilization below which a trial is diagnosed as low-utilization."),
    )
    seed: int = field(default=0, metadata=_opt("Seed of the sampler (and the simulator)."))
    sim_time_scale: float = field(
        default=0.002, metadata=_opt("Simulator: wall seconds per simulated second.")
    )
    name: str = field(default="", metadata=_opt("Study name (default: from model, GPUs and GPU type)."))
    storage: str | None = field(
        default=None,
        metadata=_opt("Optuna storage URL (default: SQLite in the study folder), e.g. postgresql://host/db."),
    )
    parallel: int | None = field(
        default=None, metadata=_opt("Trials run at once on disjoint GPU sets (default: node GPUs // --gpus).")
    )
    node_gpus: int | None = field(
        default=None,
        metadata=_opt(
            "GPUs on this node, when rehearsing with --runner sim or --gpu-type (default: NVML's count)."
        ),
    )
    workdir: str | None = None  # where relative paths in --command resolve

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: Path) -> None:
        write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> Recipe:
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise UsageError(
                f"no recipe at {path}: is this a study folder made by autotune search?"
            ) from None
        except yaml.YAMLError as exc:
            raise UsageError(
                f"{path} is not valid YAML ({exc.__class__.__name__}): fix or remove it"
            ) from None
        if not isinstance(data, dict) or "model" not in data:
            raise UsageError(f"{path} is not an autotune recipe")
        wrong = recipe_problem(data)
        if wrong:
            raise UsageError(
                f"{path}: {wrong}: restore the file from a backup, or run autotune search with the "
                "study's original flags and --name to write it again"
            )
        return cls.from_dict(data)

    def identity(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in IDENTITY_FIELDS}

    def differences(self, other: Recipe) -> list[str]:
        """Names of identity fields that differ, for a message that says what changed."""
        mine, theirs = self.identity(), other.identity()
        return [k for k in IDENTITY_FIELDS if mine[k] != theirs[k]]

    def dp_gpus(self, params: dict[str, Any]) -> int:
        """GPUs that train (data-parallel). vLLM in server mode takes its TP group away."""
        if params.get("use_vllm") and params.get("vllm_mode") == "server":
            return max(self.gpus - int(params.get("vllm_tensor_parallel_size", 1)), 0)
        return self.gpus


def recipe_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a recipe.yaml's contents (a key removed, a value of the wrong type), or
    None. The type each field takes is its default's: a hand-edited file fails here, in one line,
    not as a TypeError deep in a search."""
    for f in fields(Recipe):
        required = f.default is MISSING and f.default_factory is MISSING
        if f.name not in data:
            if required:
                return f"'{f.name}' is missing"
            continue
        value = data[f.name]
        default = f.default if f.default is not MISSING else (None if required else f.default_factory())
        if value is None and not required and default is None:
            continue
        expected = type(default) if default is not None else {"model": str, "gpus": int}.get(f.name)
        if expected is None:
            continue
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            return f"'{f.name}' is {value!r}, not of type {expected.__name__}"
    return None


def parse_duration(text: str | None) -> float | None:
    """'8h', '90m', '45s', '1h30m', '1.5d' or plain seconds -> seconds; None for no value."""
    if text is None or text == "":
        return None
    seconds = duration_seconds(text)
    if seconds is None:
        raise UsageError(f"cannot read duration '{text}': use e.g. 8h, 90m, 45s or 1h30m")
    if seconds <= 0:
        raise UsageError(f"duration '{text}' must be positive")
    return seconds


def format_duration(seconds: float) -> str:
    """The inverse, for help texts: 1800 -> '30m'."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def default_study_name(model: str, gpus: int, gpu_type: str) -> str:
    base = Path(model).name if "/" in model else model
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{base}-{gpus}x{gpu_type}").strip("-")
    return slug.lower()
