"""The ms-swift runner: each candidate becomes a real ``swift rlhf --rlhf_type grpo`` run.

ms-swift lives in an environment of its own (4.6.0 pins trl 0.29.1, which autotune's TRL worker
does not use; ``bash scripts/swift_env.sh`` makes it). autotune only runs its ``swift`` script as a
subprocess and reads the step lines it prints (:mod:`autotune.trial.logparse`), so the two never
share an interpreter. Which ``swift``: ``--swift-bin``, else the one on PATH, else the one in
scripts/swift_env.sh's default venv. Its interpreter (the script's shebang) tells the installed
version, and the flag names follow it (:class:`autotune.configs.swift.SwiftVersion`).

What a trial passes besides the candidate (:func:`autotune.configs.swift.swift_trial_argv`):

* the model: a checkpoint with weights is passed by path; a shape-only card is materialised once
  as a model directory with random weights and an offline tokenizer
  (:mod:`autotune.worker.materialise`), passed with ``--model_type`` and ``--template qwen``;
* the prompts: ``Recipe.dataset`` as given, else worst-case prompts of exactly
  ``max_prompt_length`` tokens written as chat JSON lines (and ``--truncation_strategy left``, so
  the template's own tokens cut the prompt to ``--max_length`` instead of dropping the row);
* the reward ``format`` (a regex, no network, no extra package);
* ``--max_steps`` covering warm-up and measured steps (confirmation runs included), one log line
  per step, no checkpoints, no reporting.

Files in the trial folder: ``swift_argv.json`` (the argv, the ms-swift version and the
materialised model, beside command.txt), ``prompts.jsonl``, ``ds_config.json`` when the
configuration uses autotune's DeepSpeed JSON, and ``swift_output/`` (ms-swift's output folder).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune import configs as lc
from autotune.configs.swift import OLDEST, TESTED, SwiftVersion, TrialInputs
from autotune.errors import UsageError
from autotune.models import ModelSpec
from autotune.recipe import Recipe
from autotune.runners.base import Rule, Runner
from autotune.runners.swift_env import refuse_missing, restrict
from autotune.runners.trl import free_port
from autotune.trial.launch import LaunchSpec

ARGV_FILE = "swift_argv.json"
PROMPTS_FILE = "prompts.jsonl"
DEEPSPEED_FILE = "ds_config.json"
OUTPUT_DIR = "swift_output"
#: Steps beyond what the controller needs, as the TRL runner keeps: only late log lines need them.
EXTRA_STEPS = 2
#: ms-swift's model types for the architectures autotune has cards for (config.json's model_type).
MODEL_TYPES = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llama": "llama",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}
#: The template of a materialised card: its tokenizer carries Qwen's chat markers.
SHAPE_TEMPLATE = "qwen"
INSTALL_HINT = (
    "bash scripts/swift_env.sh makes its own environment (ms-swift pins trl 0.29.1, so install it "
    "with pip install ms-swift in a separate venv), then pass --swift-bin VENV/bin/swift"
)


def default_venv() -> Path:
    """Where scripts/swift_env.sh puts ms-swift unless ``AUTOTUNE_SWIFT_VENV`` says otherwise."""
    return Path(os.environ.get("AUTOTUNE_SWIFT_VENV") or Path.home() / ".cache" / "autotune" / "swift-venv")


def find_swift(recipe: Recipe) -> Path:
    """The ``swift`` program: ``--swift-bin``, PATH, then scripts/swift_env.sh's venv (UsageError if none)."""
    if recipe.swift_bin:
        given = Path(recipe.swift_bin).expanduser()
        found = (
            shutil.which(str(given))
            if os.sep not in str(given)
            else (str(given) if given.is_file() else None)
        )
        if not found or not os.access(found, os.X_OK):
            raise UsageError(f"--swift-bin {recipe.swift_bin}: no such program; {INSTALL_HINT}")
        return Path(found).absolute()
    on_path = shutil.which("swift")
    if on_path:
        return Path(on_path).absolute()
    venv_swift = default_venv() / "bin" / "swift"
    if venv_swift.is_file() and os.access(venv_swift, os.X_OK):
        return venv_swift.absolute()
    raise UsageError(f"--runner swift: no swift program found on PATH or in {default_venv()}; {INSTALL_HINT}")


def swift_python(program: Path) -> str:
    """The interpreter of the ``swift`` script, from its shebang (``#!/venv/bin/python``)."""
    try:
        with open(program, "rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise UsageError(f"cannot read {program}: {exc.strerror}; {INSTALL_HINT}") from None
    if first.startswith("#!"):
        words = shlex.split(first[2:])
        if words and Path(words[0]).name == "env" and len(words) > 1:
            found = shutil.which(words[-1])
            if found:
                return found
        elif words and os.access(words[0], os.X_OK):
            return words[0]
    beside = program.parent / "python"
    if beside.is_file():
        return str(beside)
    raise UsageError(f"{program} names no Python interpreter in its first line; {INSTALL_HINT}")


_VERSIONS: dict[str, SwiftVersion] = {}


def swift_version(python: str) -> SwiftVersion:
    """The ms-swift version installed for ``python`` (read once per interpreter)."""
    if python in _VERSIONS:
        return _VERSIONS[python]
    try:
        done = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('ms-swift'))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(
            f"cannot run {python} to read the ms-swift version ({exc}); {INSTALL_HINT}"
        ) from None
    version = SwiftVersion.parse(done.stdout.strip()) if done.returncode == 0 else None
    if version is None:
        raise UsageError(
            f"{python} has no ms-swift installed (importlib.metadata finds no 'ms-swift'); {INSTALL_HINT}"
        )
    _VERSIONS[python] = version
    return version


def hub_id(model: ModelSpec, given: str) -> str | None:
    """A name ModelScope or the Hub resolves for a card: the alias with an organisation whose
    name is the one the user gave, else the card's first such alias; None for a test card."""
    ids = [a for a in model.card.get("aliases", []) if "/" in a]
    if "/" in given and model.source != "path":
        return given
    for alias in ids:
        if alias.split("/", 1)[1].lower() == given.lower():
            return alias
    return ids[0] if ids else None


@dataclass(frozen=True)
class SwiftModel:
    """How a model reaches ms-swift: in trials, and in the exported swift.sh."""

    shape_only: bool  # materialised from its config (no weights on disk)
    model_type: str | None
    export_model: str | None  # the hub id or path swift.sh names; None: the materialised folder
    export_template: bool  # whether swift.sh keeps the trial's --template


def swift_model(model: ModelSpec, recipe: Recipe) -> SwiftModel:
    """Weights on disk are passed by path; a card without them is materialised (see module doc)."""
    model_type = MODEL_TYPES.get(model.model_type)
    if model.has_weights and model.path:
        named = recipe.model if model.source == "hf-cache" else str(Path(model.path).resolve())
        return SwiftModel(False, model_type, named, True)
    hub = hub_id(model, recipe.model)
    return SwiftModel(True, model_type, hub, hub is None)


def export_argv(
    params: dict[str, Any], recipe: Recipe, model: ModelSpec, ds_config: str = "ds_config.json"
) -> tuple[list[str], SwiftVersion, Path | None]:
    """swift.sh's command: what a trial of ``params`` runs (:meth:`SwiftRunner.prepare`), minus
    the trial-only flags, for the ms-swift this machine has (or :data:`TESTED`, with no program)."""
    program: Path | None
    try:
        program = find_swift(recipe)
        version = swift_version(swift_python(program))
    except UsageError:
        program, version = None, TESTED
    plan = swift_model(model, recipe)
    trial_model = str(_materialised_dir(model, recipe)) if plan.shape_only else plan.export_model or ""
    inputs = _inputs(
        recipe,
        plan,
        program="swift",
        model=trial_model,
        dataset=_dataset(recipe) or PROMPTS_FILE,
        output_dir=OUTPUT_DIR,
        max_steps=1,
        ds_config_path=ds_config,
    )
    argv = lc.swift_trial_argv(params, recipe, inputs, version)
    return (
        lc.production_argv(
            argv,
            model=plan.export_model or trial_model,
            keep_dataset=bool(recipe.dataset),
            keep_template=plan.export_template,
        ),
        version,
        program,
    )


def _materialised_dir(model: ModelSpec, recipe: Recipe) -> Path:
    from autotune.worker.materialise import model_dir_for

    return model_dir_for(model.name, model.config, recipe.device)


def _dataset(recipe: Recipe) -> str | None:
    """The user's prompts as swift should read them: a local file made absolute, else as given
    (ms-swift also takes a dataset id)."""
    if not recipe.dataset:
        return None
    path = Path(recipe.dataset).expanduser()
    if path.exists():
        return str(path.resolve())
    if recipe.workdir and (Path(recipe.workdir) / path).exists():
        return str((Path(recipe.workdir) / path).resolve())
    return recipe.dataset


def _inputs(
    recipe: Recipe,
    plan: SwiftModel,
    *,
    program: str,
    model: str,
    dataset: str,
    output_dir: str,
    max_steps: int,
    ds_config_path: str,
) -> TrialInputs:
    return TrialInputs(
        program=program,
        model=model,
        model_type=plan.model_type,
        template=SHAPE_TEMPLATE if plan.shape_only else None,
        dataset=dataset,
        output_dir=output_dir,
        max_steps=max_steps,
        ds_config_path=ds_config_path,
        truncate_left=not recipe.dataset,
    )


class SwiftRunner(Runner):
    """Trials that run ms-swift's GRPO on the recipe's model, on GPUs or (rehearsal) on CPU."""

    name = "swift"
    #: Parallel trials' slot threads share one runner per slot; the first to need the shape-only
    #: model builds it and the rest wait for it here instead of each writing a copy at once (the
    #: on-disk done marker and lock in :mod:`autotune.worker.materialise` cover other processes).
    _materialising = threading.Lock()

    def __init__(self, context) -> None:
        super().__init__(context)
        self.program: Path | None = None
        self.python: str | None = None
        self.version: SwiftVersion | None = None

    # -- up front -------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail before the first trial when no trial could run: swift, its version, the inputs."""
        recipe = self.recipe
        self.check_inputs()
        if recipe.device not in ("cuda", "cpu"):
            raise UsageError(f"--device {recipe.device!r}: use cuda or cpu")
        if recipe.device == "cuda" and recipe.memory_limit_gib:
            raise UsageError(
                "--memory-limit caps a trial's address space (RLIMIT_AS), which CUDA cannot "
                "start under: use it with --device cpu"
            )
        try:
            shlex.split(recipe.swift_args or "")
        except ValueError as exc:
            raise UsageError(f"--swift-args cannot be split like a shell line: {exc}") from None
        if (
            recipe.dataset
            and _looks_local(recipe.dataset)
            and _dataset(recipe) == recipe.dataset
            and not Path(recipe.dataset).expanduser().exists()
        ):
            raise UsageError(f"--dataset {recipe.dataset}: no such file")
        self.program = find_swift(recipe)
        self.python = swift_python(self.program)
        self.version = swift_version(self.python)
        if not self.version.supported:
            raise UsageError(
                f"ms-swift {self.version} at {self.program} is too old: autotune needs ms-swift >= "
                f"{OLDEST} (GRPO with --vllm_mode); upgrade it, e.g. bash scripts/swift_env.sh"
            )
        refuse_missing(self.python, recipe.quantization)

    def check_inputs(self) -> None:
        """Refuse what a swift trial would not measure: its prompts are text only (worst-case chat
        rows or the user's dataset as given), so image tokens would make the planner count images
        and vision activations that no trial ever carries."""
        if int(self.recipe.image_tokens or 0) > 0:
            raise UsageError(
                f"--image-tokens {self.recipe.image_tokens} with --runner swift: the swift runner runs "
                "text-only trials (no images); leave --image-tokens out, or use --runner trl"
            )

    def rules(self) -> list[Rule]:
        """Candidates this ms-swift or machine cannot run, each with a one-line reason."""
        cpu = self.recipe.device == "cpu"
        version = self.version or TESTED

        def vllm_rule(params: dict[str, Any]) -> str | None:
            if not params.get("use_vllm"):
                return None
            if cpu:
                return "use_vllm: vLLM needs a GPU (--device cpu); pin --set use_vllm=false"
            if params.get("vllm_mode") == "server":
                return "vllm_mode=server: the swift runner starts no swift rollout server; search colocate"
            return None

        def sleep_rule(params: dict[str, Any]) -> str | None:
            level = int(params.get("sleep_level") or 0)
            if level > version.max_sleep_level:
                return (
                    f"sleep_level={level} needs ms-swift >= 3.12.0 (older releases do not reload the "
                    f"weights after a level-2 sleep); this is {version}"
                )
            return None

        def deepspeed_rule(params: dict[str, Any]) -> str | None:
            if params.get("deepspeed_config", "preset") != "autotune":
                return None
            if not lc.uses_deepspeed(params, self.recipe):
                return "deepspeed_config=autotune without ZeRO: the same run as deepspeed_config=preset"
            if lc.swift_deepspeed(params, self.recipe) is None:
                return (
                    "deepspeed_config=autotune: ms-swift has no preset for this stage/offload, so preset "
                    "already uses autotune's JSON"
                )
            return None

        return [vllm_rule, sleep_rule, deepspeed_rule]

    def forced(self) -> dict[str, Any]:
        """CPU trials run without vLLM; what ms-swift's own environment lacks is not searched."""
        _, python, _ = self._ready()
        cpu = self.recipe.device == "cpu"
        out = restrict(python, cpu=cpu, processes=int(self.recipe.gpus))
        return {**out, "use_vllm": False} if cpu else out

    # -- one trial ------------------------------------------------------------------------------
    def max_steps(self) -> int:
        default = int(self.recipe.warmup_steps) + int(self.recipe.measure_steps) + EXTRA_STEPS
        return max(default, (self.steps_needed or 0) + EXTRA_STEPS)

    def _ready(self) -> tuple[Path, str, SwiftVersion]:
        if self.program is None or self.python is None or self.version is None:
            self.check()
        assert self.program is not None and self.python is not None and self.version is not None
        return self.program, self.python, self.version

    def model_dir(self) -> tuple[SwiftModel, str]:
        """The model as trials pass it: a path with weights, or the materialised card (built once)."""
        program, python, _ = self._ready()
        plan = swift_model(self.context.model, self.recipe)
        model = self.context.model
        if not plan.shape_only:
            return plan, str(model.path.resolve()) if model.path else self.recipe.model
        from autotune.worker.materialise import ensure_model

        try:
            with SwiftRunner._materialising:
                return plan, str(ensure_model(python, model.name, model.config, self.recipe.device))
        except RuntimeError as exc:
            raise UsageError(f"cannot materialise model {model.name} for ms-swift: {exc}") from None

    def prompts(self, params: dict[str, Any], trial_dir: Path, model_dir: str, steps: int) -> str:
        """The prompts file of a trial: the user's ``--dataset``, or worst-case chat rows."""
        given = _dataset(self.recipe)
        if given:
            return given
        from autotune.worker.data import prompts_needed
        from autotune.worker.materialise import write_prompts

        eff = lc.effective(params, self.recipe)
        rows = 2 * prompts_needed(self.recipe.completions_per_step(eff), int(eff["num_generations"]), steps)
        # the prompt text depends on the tokenizer and length only: made once per study, then repeated
        length = int(self.recipe.max_prompt_length)
        one = trial_dir.parent.parent / "swift" / f"prompt-{length}.jsonl"
        if not one.is_file():
            try:
                write_prompts(self._ready()[1], Path(model_dir), length, 1, one)
            except RuntimeError as exc:
                raise UsageError(
                    f"cannot write the trial prompts with {model_dir}'s tokenizer: {exc}"
                ) from None
        row = one.read_text(encoding="utf-8").splitlines()[0]
        path = trial_dir / PROMPTS_FILE
        path.write_text((row + "\n") * rows, encoding="utf-8")
        return str(path.resolve())

    def prepare(self, params: dict[str, Any], trial_dir: Path, number: int) -> LaunchSpec:
        recipe = self.recipe
        program, _, version = self._ready()
        trial_dir = Path(trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        plan, model_dir = self.model_dir()
        steps = self.max_steps()
        dataset = self.prompts(params, trial_dir, model_dir, steps)
        ds_path = trial_dir / DEEPSPEED_FILE
        if lc.uses_deepspeed(params, recipe):
            ds = lc.deepspeed_config(params, recipe)
            if ds is not None:
                ds_path.write_text(json.dumps(ds, indent=2), encoding="utf-8")
        inputs = _inputs(
            recipe,
            plan,
            program=str(program),
            model=model_dir,
            dataset=dataset,
            output_dir=str((trial_dir / OUTPUT_DIR).resolve()),
            max_steps=steps,
            ds_config_path=str(ds_path.resolve()),
        )
        argv = lc.swift_trial_argv(params, recipe, inputs, version)
        (trial_dir / ARGV_FILE).write_text(
            json.dumps(
                {
                    "argv": argv,
                    "ms_swift": str(version),
                    "model_dir": model_dir,
                    "shape_only": plan.shape_only,
                },
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )

        env = self.base_env(trial_dir)
        processes = recipe.dp_gpus(params)
        if processes > 1:  # set at all, it makes swift launch through torch.distributed.run
            env["NPROC_PER_NODE"] = str(processes)
            # ms-swift passes --master_port only when MASTER_PORT is set, else torch's 29500: two
            # parallel multi-process trials would both bind it and one would die of EADDRINUSE
            env["MASTER_PORT"] = str(free_port())
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if recipe.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["OMP_NUM_THREADS"] = str(max(1, min(4, (os.cpu_count() or 1) // max(processes, 1))))
            # glibc's per-thread arenas reserve address space, which RLIMIT_AS (--memory-limit) counts
            env.setdefault("MALLOC_ARENA_MAX", "2")
        return LaunchSpec(
            argv=argv, env=env, trial_dir=trial_dir, cwd=trial_dir, memory_limit_gib=recipe.memory_limit_gib
        )


def _looks_local(text: str) -> bool:
    return text.startswith((".", "/", "~")) or text.endswith((".jsonl", ".json", ".csv"))
