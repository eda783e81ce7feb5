"""The policy model of a trial: the checkpoint when its weights are on disk, else shape-only.

A model whose weights are not on disk is built from its config with random weights: memory and
speed depend on shapes, not values. Its config goes to ``trial_dir/model`` (:data:`SHAPE_DIR`) and,
for vLLM, the trial's tokenizer to ``trial_dir/tokenizer`` (:data:`TOKENIZER_DIR`); TRL's own
loaders of the reference model and the vLLM engine are redirected there by
:func:`_shape_only_hooks`. :func:`peft_config` is the LoRA that ``--lora-rank`` asks for.

A quantized base (``--quantization``, the spec's ``quantization_config``) is loaded the way a real
run loads it, through ``from_pretrained(..., quantization_config=...)``: transformers cannot
quantize a model built from a config, so a shape-only policy is first saved with its random
weights and then loaded quantized from there. That folder is the model's size in full precision
(~15 GB for a 7B card), so it is not written per trial: it is cached by content like
:mod:`autotune.worker.materialise`'s models (``$AUTOTUNE_CACHE_DIR`` or ``~/.cache/autotune``, then
``quantized-bases/<name>-<dtype>-<digest>``), built once under a file lock that the other ranks
and parallel trials wait on, and reused by later trials and studies. bitsandbytes 0.50 runs NF4 and
int8 layers forward and backward on the CPU as well (tests/test_quantization.py), so a CPU trial
exercises the real QLoRA path.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from autotune.configs.trl import lora_adapter
from autotune.worker.console import say

__all__ = [
    "SHAPE_DIR",
    "TOKENIZER_DIR",
    "build_model",
    "peft_config",
    "write_shape_dir",
    "write_tokenizer_dir",
    "write_weights_dir",
]


def _model_dtype(device: str) -> Any:
    import torch

    return torch.bfloat16 if device == "cuda" else torch.float32


def _zero3(spec: dict[str, Any]) -> bool:
    return int(spec.get("params", {}).get("zero_stage") or 0) == 3 and spec["device"] == "cuda"


def _random_model(config_dir: Path, dtype: Any, build_on: Any, attn_implementation: str | None = None) -> Any:
    """A causal LM (or vision-language model) with random weights from ``config_dir/config.json``.

    ``build_on`` is a device to create the tensors on directly (initialising a 7B model on the host
    first would take minutes and the host RAM of every rank), or None to let transformers decide
    (ZeRO-3 partitions at creation under ``deepspeed.zero.Init``).
    """
    import contextlib

    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(config_dir))
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    place = torch.device(build_on) if build_on is not None else contextlib.nullcontext()
    with place:
        model = _auto_class(config.to_dict()).from_config(config, **kwargs)
    model.config._name_or_path = str(config_dir)
    return model


def _auto_class(config: dict[str, Any]) -> Any:
    """The auto class a real run loads this config with: a VL model (``vision_config``) as an
    image-text-to-text model, tower included (as TRL loads one), anything else as a causal LM."""
    import transformers

    if config.get("vision_config"):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


SHAPE_DIR = "model"
TOKENIZER_DIR = "tokenizer"


def _publish_dir(dest: Path, fill: Any) -> Path:
    """Create folder ``dest`` whole or not at all: ``fill(tmp)`` writes it, a rename publishes it.

    Every rank of a multi-process trial builds the same folder at the same moment; a rank that
    read a half-written config.json would crash. The first rename wins and the others discard
    their identical copy.
    """
    if dest.is_dir():
        return dest
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    fill(tmp)
    try:
        os.rename(tmp, dest)
    except OSError:  # another rank published it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def write_shape_dir(model_info: dict[str, Any], trial_dir: Path, device: str) -> Path:
    """``trial_dir/model/config.json`` in the trial's dtype: the policy's "path" when shape-only.

    The dtype matters for vLLM, which reads it from the config: some cards record float32
    (tiny-qwen) and the engine would otherwise be built in that dtype.
    """
    from autotune.models import ModelSpec, write_config_dir

    config = dict(model_info["config"])
    config["torch_dtype"] = "bfloat16" if device == "cuda" else "float32"
    shape = ModelSpec(
        name=model_info["name"],
        config=config,
        source=model_info.get("source", "card"),
        path=None,
        has_weights=False,
    )
    return _publish_dir(Path(trial_dir) / SHAPE_DIR, lambda tmp: write_config_dir(shape, tmp))


def write_tokenizer_dir(tokenizer: Any, trial_dir: Path) -> Path:
    """``trial_dir/tokenizer``: the trial's tokenizer for vLLM, in a folder of its own.

    Not beside config.json: transformers 5 would load it there as the model type's tokenizer
    class (``Qwen2Tokenizer`` for qwen2 configs), which cannot read a word-level tokenizer.json.
    """
    return _publish_dir(Path(trial_dir) / TOKENIZER_DIR, lambda tmp: tokenizer.save_pretrained(str(tmp)))


def _shape_only_hooks(model_dir: Path, build_on: Any, tokenizer_dir: Path | None, dummy: bool = True) -> None:
    """Make TRL build its extra model copies from the config when the policy has no weights.

    TRL 1.16 creates the reference model (beta > 0, no PEFT) with
    ``create_model_from_path(policy.config._name_or_path, dtype=policy.dtype, ...)`` and the
    colocated vLLM engine with ``LLM(model=policy.name_or_path, ...)``; both would try to load
    weights that do not exist. The reference model is replaced by a random one of the same
    architecture and dtype (what it costs in memory and time is all a trial needs), and vLLM gets
    ``load_format="dummy"`` (its own random-weight loader; TRL pushes the policy's weights into
    it before generating anyway) and the trial's tokenizer directory. Only calls for
    ``model_dir`` are redirected. With ``dummy=False`` (a quantized policy saved with its random
    weights) vLLM loads those weights and only gets the tokenizer.
    """
    import trl.trainer.grpo_trainer as grpo_trainer

    original = grpo_trainer.create_model_from_path

    @functools.wraps(original)
    def create_model_from_path(model_id: str, architecture: Any = None, **kwargs: Any) -> Any:
        if Path(str(model_id)) != model_dir:
            return original(model_id, architecture, **kwargs)
        say("reference model: random weights of the same shape (shape-only)")
        dtype = kwargs.get("dtype") or "float32"
        if isinstance(dtype, str):
            import torch

            dtype = getattr(torch, dtype)
        return _random_model(model_dir, dtype, build_on, kwargs.get("attn_implementation"))

    grpo_trainer.create_model_from_path = create_model_from_path

    try:
        import trl.generation.vllm_generation as vllm_generation
    except ImportError:
        return
    if hasattr(vllm_generation, "LLM") and tokenizer_dir is not None:
        extra = {"load_format": "dummy"} if dummy else {}
        vllm_generation.LLM = functools.partial(vllm_generation.LLM, tokenizer=str(tokenizer_dir), **extra)


def build_model(spec: dict[str, Any], args: Any, tokenizer: Any) -> Any:
    """The policy: the checkpoint when its weights are here, else random weights (shape-only);
    loaded quantized when the spec carries a ``quantization_config``."""
    device = spec["device"]
    dtype = _model_dtype(device)
    model_info = spec["model"]
    # Where to create tensors: the trial's device, unless ZeRO-3 must partition them at creation
    build_on = args.device if device == "cuda" and not _zero3(spec) else None
    quantization = spec.get("quantization_config")
    if model_info.get("has_weights") and model_info.get("path"):
        return _load(model_info["path"], dtype, build_on, quantization)

    use_vllm = bool(spec["grpo_config"].get("use_vllm"))
    tokenizer_dir = write_tokenizer_dir(tokenizer, Path(spec["trial_dir"])) if use_vllm else None
    say(
        f"model {model_info['name']}: no weights on disk, using random weights (shape-only: memory and "
        f"speed depend on shapes, not values), {str(dtype).replace('torch.', '')} on {device}"
    )
    if quantization:
        model_dir = write_weights_dir(model_info, Path(spec["trial_dir"]), device, dtype)
        if use_vllm:
            _shape_only_hooks(model_dir, build_on, tokenizer_dir, dummy=False)
        return _load(model_dir, dtype, build_on, quantization)
    model_dir = write_shape_dir(model_info, Path(spec["trial_dir"]), device)
    if spec["grpo_config"].get("beta") or use_vllm:
        _shape_only_hooks(model_dir, build_on, tokenizer_dir)
    return _random_model(model_dir, dtype, build_on)


def _load(path: Any, dtype: Any, build_on: Any, quantization: dict[str, Any] | None) -> Any:
    """``from_pretrained`` as a real run calls it: the trial's dtype, on its device, quantized
    when the recipe asks (bitsandbytes quantizes the linears as they load)."""
    import json

    import torch

    kwargs: dict[str, Any] = {"dtype": dtype}
    if build_on is not None:
        kwargs["device_map"] = {"": torch.device(build_on)}
    if quantization:
        kwargs["quantization_config"] = dict(quantization)
        say(f"base quantized while loading: {', '.join(f'{k}={v}' for k, v in quantization.items())}")
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return _auto_class(config).from_pretrained(str(path), **kwargs)


#: Bumped when the layout of a cached quantized base changes, so an old entry is not reused.
WEIGHTS_FORMAT = 1


def weights_dir_for(model_info: dict[str, Any], device: str) -> Path:
    """The cache folder of a card's random full-precision weights in the trial's dtype."""
    from autotune.worker.materialise import cache_base, content_key

    dtype = "bfloat16" if device == "cuda" else "float32"
    return (
        cache_base()
        / "quantized-bases"
        / content_key(model_info["name"], model_info["config"], dtype, WEIGHTS_FORMAT)
    )


def write_weights_dir(model_info: dict[str, Any], trial_dir: Path, device: str, dtype: Any) -> Path:
    """A folder with config.json *and* random weights, for a base that must be loaded quantized
    (transformers quantizes only in ``from_pretrained``). It costs the model's size on disk, so it
    is the shared cache entry (see the module doc), not a copy in ``trial_dir``: the first rank
    builds it under the lock, the others wait and load it. Built on the host, so the
    full-precision copy never shows in the GPU's measured peak."""
    from autotune.worker.materialise import build_lock

    dest = weights_dir_for(model_info, device)

    def fill(tmp: Path) -> None:
        config_dir = write_shape_dir(model_info, tmp / "config", device)
        model = _random_model(config_dir, dtype, "cpu")
        model.save_pretrained(str(tmp))
        del model
        import shutil

        shutil.rmtree(tmp / "config", ignore_errors=True)

    if dest.is_dir():
        return dest
    with build_lock(dest):
        return _publish_dir(dest, fill)


def peft_config(spec: dict[str, Any]) -> Any:
    """LoRA on every linear layer when the recipe asks for a rank, as ``--lora-rank`` promises."""
    rank = spec.get("lora_rank")
    if not rank:
        return None
    from peft import LoraConfig

    return LoraConfig(**lora_adapter(int(rank)), task_type="CAUSAL_LM")
