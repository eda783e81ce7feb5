"""The TRL runner: each candidate becomes a real ``GRPOTrainer`` run (:mod:`autotune.worker`).

``prepare`` writes the trial's files and returns how to launch it; the launcher runs it, the
monitor reads its metrics file and the classifier reads its traceback. Files in the trial folder:

``trial_spec.json`` (read by the worker; version 1)::

    {"version": 1, "number": 7, "trial_dir": "/abs/runs/s/trials/7",
     "params": {...the candidate...},
     "grpo_config": {...configs.grpo_config_kwargs(params, recipe)...},
     "model": {"name": "tiny-qwen", "source": "card", "path": null, "has_weights": false,
               "config": {...config.json...}},
     "device": "cuda" | "cpu", "max_prompt_length": 512, "max_completion_length": 1024,
     "image_tokens": 0, "images_per_prompt": 1, "max_steps": 7, "lora_rank": null,
     "dataset": null | "/abs/prompts.jsonl", "seed": 0,
     "processes": 4, "quantization_config": null | {...BitsAndBytesConfig fields...},
     "recipe": {...Recipe.to_dict()...}}

``accelerate_config.yaml`` (+ ``ds_config.json`` with ZeRO >= 1, GPUs or CPU): for multi-process or
DeepSpeed trials, from :mod:`autotune.configs`, the same generator the export uses.

Launch (no shell; ``python`` is this interpreter)::

    single process:  python -m autotune.worker --trial-spec trial_spec.json
    multi-process:   python -m accelerate.commands.launch --config_file accelerate_config.yaml
                         --num_processes N --main_process_port P [--multi_gpu] -m autotune.worker
                         --trial-spec trial_spec.json

``--multi_gpu`` is added on CPU without DeepSpeed only: the exported CPU config says ``MULTI_CPU``,
which accelerate 1.15 hands to its single-process launcher (meant for ``mpirun``); ``--multi_gpu``
makes it start N processes with torchrun, and ``use_cpu`` in the config puts them on gloo. A
``DEEPSPEED`` config starts torchrun itself, and DeepSpeed's CPU accelerator picks gloo. The main
process port is a free port picked per trial, so a trial's leftovers never block the next rendezvous.

vLLM server mode: the trial's :attr:`LaunchSpec.sidecars` holds the ``trl vllm-serve`` process
on the GPUs training does not use. :meth:`TrlRunner.start_services` starts it and waits for its
health endpoint before the trial is launched, and :meth:`TrlRunner.stop_services` stops it after;
a server that does not come up raises :class:`ServiceFailed` with its log, so the trial is
recorded from the server's own error (a vLLM start-up OOM reads like one). Each server has its
own free port (``--port`` and the worker's ``vllm_server_port``), a pid file in its folder and the
trial's ``AUTOTUNE_TRIAL_DIR`` marker, so a resume finds it after a crash; a health answer counts
only from our own live server.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import yaml

from autotune import configs as lc
from autotune.candidate.footprint import base_quantization
from autotune.configs.trl import quantization_config
from autotune.errors import UsageError
from autotune.runners.base import Rule, Runner, free_port, max_steps
from autotune.runners.sidecar import (
    start_sidecar,
    stop_sidecar,  # noqa: F401 (re-exported)
    vllm_health_url,
    wait_health,
)
from autotune.trial.launch import LaunchSpec, ServiceFailed
from autotune.trial.layout import TrialFiles
from autotune.trial.processes import TRIAL_ENV

#: Packages a real trial imports; ``check`` names the missing ones in one line.
REQUIRED = ("torch", "transformers", "trl", "accelerate", "datasets")
SPEC_FILE = "trial_spec.json"
ACCELERATE_FILE = "accelerate_config.yaml"
DEEPSPEED_FILE = "ds_config.json"
SIDECAR_DIR = "vllm_server"


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (found, not imported: vllm takes seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _uses_zero(params: dict[str, Any]) -> bool:
    return int(params.get("zero_stage") or 0) > 0 or (params.get("offload") or "none") != "none"


log = logging.getLogger(__name__)


class TrlRunner(Runner):
    """Trials that run TRL's GRPOTrainer on the recipe's model, on GPUs or (rehearsal) on CPU."""

    name = "trl"

    # -- up front -------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail before the first trial when no trial could run: packages, GPUs, files."""
        missing = [p for p in REQUIRED if not installed(p)]
        if self.recipe.lora_rank and not installed("peft"):
            missing.append("peft")
        if missing:
            raise UsageError(f"the trl runner needs {', '.join(missing)}: pip install -e '.[trl]'")
        if self.recipe.device not in ("cuda", "cpu"):
            raise UsageError(f"--device {self.recipe.device!r}: use cuda or cpu")
        if self.recipe.device == "cuda" and self.recipe.memory_limit_gib:
            raise UsageError(
                "--memory-limit caps a trial's address space (RLIMIT_AS), which CUDA cannot "
                "start under: use it with --device cpu"
            )
        if self.recipe.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError(
                    "no CUDA GPU is visible to torch: use --device cpu for a CPU rehearsal "
                    "with real TRL trials, or --runner sim to simulate GPUs"
                )
        self.check_model()
        if self.recipe.dataset and not Path(self.recipe.dataset).expanduser().is_file():
            raise UsageError(
                f"--dataset {self.recipe.dataset}: no such file (a JSON-lines file with a 'prompt' field)"
            )

    def check_model(self) -> None:
        """What of the model the worker cannot build: images it cannot make (Pillow missing, a
        token count no image has, a ``--dataset`` of text beside synthetic images), a GPTQ/AWQ
        checkpoint without its weights (transformers loads those only from the quantized files),
        bitsandbytes missing for --quantization. A vision-language model runs with synthetic
        images of ``--image-tokens`` tokens (:mod:`autotune.worker.vision`)."""
        model, recipe = self.context.model, self.recipe
        if model.vision is not None and recipe.image_tokens and recipe.images_per_prompt:
            from autotune.worker.vision import image_grid

            image_grid(recipe.image_tokens)
            if not installed("PIL"):
                raise UsageError(
                    f"model {model.name!r} with --image-tokens: the trl runner's synthetic images need "
                    "Pillow: pip install pillow"
                )
            if recipe.dataset:
                raise UsageError(
                    "--dataset with --image-tokens: vision-language trials use synthetic prompts and "
                    "images of the asked sizes; leave out --dataset"
                )
        quant = base_quantization(model, recipe.quantization, recipe.lora_rank)
        if quant is not None and quant.origin == "checkpoint" and not (model.has_weights and model.path):
            raise UsageError(
                f"model {model.name!r} is a {quant.label} checkpoint: the trl runner loads it only from "
                "its quantized weights, so pass the checkpoint's directory"
            )
        if recipe.quantization and not installed("bitsandbytes"):
            raise UsageError(
                f"--quantization {recipe.quantization} needs bitsandbytes: pip install bitsandbytes"
            )

    def rules(self) -> list[Rule]:
        """Candidates this machine cannot run, each with a one-line reason (marked invalid)."""
        cpu = self.recipe.device == "cpu"
        have_vllm = installed("vllm")
        have_deepspeed = installed("deepspeed")

        def vllm_rule(params: dict[str, Any]) -> str | None:
            if not params.get("use_vllm"):
                return None
            if cpu:
                return "use_vllm: vLLM needs a GPU (--device cpu); pin --set use_vllm=false"
            if not have_vllm:
                return "use_vllm needs the vllm package (pip install -e '.[vllm]')"
            if self._vl_without_processor():
                return (
                    "use_vllm with a vision-language model needs its checkpoint folder (weights and "
                    "preprocessor_config.json): vLLM builds its own processor from it; "
                    "pin --set use_vllm=false"
                )
            return None

        def deepspeed_rule(params: dict[str, Any]) -> str | None:
            if not _uses_zero(params) or have_deepspeed:
                return None
            what = f"zero_stage={params.get('zero_stage', 0)}, offload={params.get('offload', 'none')}"
            return f"{what} needs the deepspeed package (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')"

        def int8_vllm_rule(params: dict[str, Any]) -> str | None:
            if self.recipe.quantization != "8bit" or not params.get("use_vllm"):
                return None
            if params.get("vllm_mode", "colocate") != "colocate":
                return None
            return (
                "--quantization 8bit with colocated vLLM: TRL 1.16 refuses it ('vLLM does not support "
                "in-flight 8-bit quantization.'); use 4bit or vllm_mode=server"
            )

        return [vllm_rule, deepspeed_rule, int8_vllm_rule]

    def forced(self) -> dict[str, Any]:
        """CPU trials run without vLLM (DeepSpeed ZeRO runs on CPU, gloo + CPU Adam); a machine
        without vllm or deepspeed searches what it can run (a log line says so) instead of
        refusing everything."""
        out: dict[str, Any] = {"use_vllm": False} if self.recipe.device == "cpu" else {}
        if not out and not installed("vllm"):
            log.warning(
                "vllm is not installed: searching without vLLM generation "
                "(pip install -e '.[vllm]' to include it)"
            )
            out["use_vllm"] = False
        if not out and self._vl_without_processor():
            log.warning(
                "model %s is vision-language without its checkpoint folder: searching with transformers "
                "generation (vLLM would need the real processor files)",
                self.context.model.name,
            )
            out["use_vllm"] = False
        if not installed("deepspeed"):
            log.warning(
                "deepspeed is not installed: searching ZeRO stage 0 only "
                "(DS_BUILD_OPS=0 pip install -e '.[deepspeed]' to include ZeRO and offload)"
            )
            out.update(zero_stage=0, offload="none")
        return out

    def _vl_without_processor(self) -> bool:
        """A vision-language model vLLM cannot serve here: vLLM builds the model's processor from
        its folder, and a shape-only model (a card, a bare config) has none; the worker's offline
        processor lives in the trial process only."""
        model = self.context.model
        if model.vision is None:
            return False
        return not (
            model.has_weights and model.path and (Path(model.path) / "preprocessor_config.json").is_file()
        )

    # -- one trial ------------------------------------------------------------------------------
    def trial_spec(
        self, params: dict[str, Any], trial_dir: Path, number: int, steps_needed: int | None = None
    ) -> dict[str, Any]:
        """What the worker needs, as plain JSON (format in the module docstring)."""
        recipe, model = self.recipe, self.context.model
        dataset = str(Path(recipe.dataset).expanduser().resolve()) if recipe.dataset else None
        return {
            "version": 1,
            "number": number,
            "trial_dir": str(trial_dir.resolve()),
            "params": dict(params),
            "grpo_config": lc.grpo_config_kwargs(params, recipe),
            "model": {
                "name": model.name,
                "source": model.source,
                "path": str(model.path) if model.path else None,
                "has_weights": bool(model.has_weights),
                "config": model.config,
            },
            "device": recipe.device,
            "max_prompt_length": int(recipe.max_prompt_length),
            "max_completion_length": int(recipe.max_completion_length),
            "image_tokens": int(recipe.image_tokens or 0) if model.vision is not None else 0,
            "images_per_prompt": int(recipe.images_per_prompt or 0),
            "max_steps": max_steps(self.recipe, steps_needed),
            "lora_rank": recipe.lora_rank,
            "dataset": dataset,
            # a different seed per trial, the same on resume
            "seed": zlib.crc32(f"{recipe.seed}:{number}".encode()) % 2**31,
            "processes": recipe.dp_gpus(params),
            "quantization_config": quantization_config(recipe),
            "recipe": recipe.to_dict(),
        }

    def prepare(
        self, params: dict[str, Any], trial_dir: Path, number: int, steps_needed: int | None = None
    ) -> LaunchSpec:
        recipe = self.recipe
        trial_dir = Path(trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        spec = self.trial_spec(params, trial_dir, number, steps_needed)
        train, server = lc.gpu_split(params, recipe)
        port = free_port() if server and not recipe.device == "cpu" else None
        if port is not None:  # the trainer's client and the server meet on this trial's own port
            spec["grpo_config"]["vllm_server_port"] = port
        spec_path = trial_dir / SPEC_FILE
        spec_path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
        processes = int(spec["processes"])
        cpu = recipe.device == "cpu"

        worker = ["-m", "autotune.worker", "--trial-spec", str(spec_path.resolve())]
        if processes > 1 or lc.uses_deepspeed(params, recipe):
            config_path = self.write_launch_configs(params, trial_dir)
            argv = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(config_path),
                "--num_processes",
                str(processes),
                "--main_process_port",
                str(free_port()),
            ]
            if cpu and processes > 1 and not lc.uses_deepspeed(params, recipe):
                argv.append("--multi_gpu")
            argv += worker
        else:
            argv = [sys.executable, *worker]

        env = self.base_env(trial_dir)
        # a trial never waits on the Hub (models and tokenizers are local) nor forks tokenizer threads
        env.update(
            {
                k: v
                for k, v in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"))
                if k not in os.environ
            }
        )
        devices = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d]
        if cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
            # N processes on a shared host: more threads than cores only thrashes
            env["OMP_NUM_THREADS"] = str(max(1, min(4, (os.cpu_count() or 1) // max(processes, 1))))
            # glibc reserves up to 64 MiB of address space per thread arena; under --memory-limit
            # (RLIMIT_AS counts address space) that would make the cap depend on the thread count
            env.setdefault("MALLOC_ARENA_MAX", "2")
        elif server:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i] for i in train if i < len(devices))
        sidecars = []
        if port is not None:
            sidecars.append(
                self.vllm_sidecar(
                    params, trial_dir, [devices[i] for i in server if i < len(devices)], port=port
                )
            )
        return LaunchSpec(
            argv=argv,
            env=env,
            trial_dir=trial_dir,
            memory_limit_gib=recipe.memory_limit_gib,
            sidecars=sidecars,
        )

    def write_launch_configs(self, params: dict[str, Any], trial_dir: Path) -> Path:
        """accelerate_config.yaml (+ ds_config.json) in the trial folder, as the export writes them."""
        ds_path = None
        if lc.uses_deepspeed(params, self.recipe):
            ds = lc.deepspeed_config(params, self.recipe)
            if ds is not None:
                ds_path = trial_dir / DEEPSPEED_FILE
                ds_path.write_text(json.dumps(ds, indent=2), encoding="utf-8")
        config = lc.accelerate_config(params, self.recipe, str(ds_path.resolve()) if ds_path else None)
        path = trial_dir / ACCELERATE_FILE
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    def start_services(self, spec: LaunchSpec) -> list[Any]:
        """Start the vLLM server of a server-mode trial and wait for ``/health/``."""
        procs: list[tuple[LaunchSpec, subprocess.Popen]] = []
        for side in spec.sidecars:
            try:
                proc = start_sidecar(side)
            except RuntimeError as exc:
                self.stop_services(procs)
                raise ServiceFailed(str(exc), None, "") from exc
            procs.append((side, proc))
            try:
                wait_health(
                    vllm_health_url(side.port or lc.DEFAULT_VLLM_SERVER_PORT),
                    timeout_s=self.recipe.hang_timeout_s,
                    proc=proc,
                )
            except (RuntimeError, TimeoutError) as exc:
                self.stop_services(procs)
                err = TrialFiles(side.trial_dir).stderr
                text = err.read_text(errors="replace")[-200_000:] if err.exists() else ""
                raise ServiceFailed(str(exc), proc.returncode, text) from exc
        return procs

    def stop_services(self, handles: list[Any]) -> None:
        for side, proc in handles:
            stop_sidecar(proc, pid_dir=side.trial_dir, marker=Path(side.env.get(TRIAL_ENV, side.trial_dir)))

    def vllm_sidecar(
        self,
        params: dict[str, Any],
        trial_dir: Path,
        devices: list[str],
        port: int = lc.DEFAULT_VLLM_SERVER_PORT,
    ) -> LaunchSpec:
        """The ``trl vllm-serve`` process of a server-mode trial, on the GPUs training leaves.

        A model without weights is served from the trial's shape directory (config.json in bf16,
        written here because the server starts before the worker) with vLLM's
        ``--load-format dummy`` and the offline tokenizer's own folder (``--tokenizer``), which
        ``trl vllm-serve`` forwards to ``vllm serve``.
        """
        from autotune.worker.model import write_shape_dir, write_tokenizer_dir

        model = self.context.model
        if model.has_weights and model.path:
            served = str(model.path)
            extra: list[str] = []
        else:
            from autotune.worker.tokenizer import load_tokenizer

            info = {"name": model.name, "source": model.source, "config": model.config}
            served = str(write_shape_dir(info, trial_dir, "cuda").resolve())
            tokenizer_dir = write_tokenizer_dir(load_tokenizer(model.config, None), trial_dir)
            extra = ["--load-format", "dummy", "--tokenizer", str(tokenizer_dir.resolve())]
        argv = lc.vllm_serve_command(params, self.recipe, served, port=port)
        # the same venv's trl, whatever is first on PATH
        argv = [sys.executable, "-m", "trl.cli.main", *argv[1:], *extra]
        env = self.base_env(trial_dir)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        return LaunchSpec(
            argv=argv, env=env, trial_dir=trial_dir / SIDECAR_DIR, memory_limit_gib=None, port=port
        )
