"""A shape-only model as a real model directory, for trainers that load models by path (ms-swift).

The TRL worker builds a card's random-weight model in memory. ms-swift cannot be handed a model
object: it loads ``--model DIR`` itself, so the card is written out once as what a checkpoint
looks like on disk:

* ``config.json`` in the trial dtype (bfloat16 on GPUs, float32 on CPU);
* random weights as safetensors, written tensor by tensor in shards, so a 7B card never needs its
  whole model in memory: matrices ~ N(0, initializer_range), norms 1, biases 0 (finite values
  only: a NaN would end sampling, not measure it);
* a byte-level BPE tokenizer with no merges (every byte one token, so a prompt of L ``x`` is L
  tokens) and the Qwen chat markers ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` with a
  Qwen-style chat template. transformers 5 rebuilds a ``qwen2`` model's tokenizer as its own
  ``Qwen2Tokenizer`` from the vocabulary; a byte-level BPE survives that rebuild (a word-level one,
  like :func:`autotune.worker.tokenizer.synthetic_tokenizer`, would encode every text to nothing).

Memory and speed depend on shapes and lengths, not on values or token identities, so this stands
in for the checkpoint exactly as the TRL worker's shape-only model does. Decoding skips ids the
tokenizer does not know, so the model's full vocabulary can be sampled.

The directory is cached by content (``$AUTOTUNE_CACHE_DIR`` or ``~/.cache/autotune``, then
``swift-models/<name>-<dtype>-<digest>``): the trials of a study, and of later studies, reuse it,
and the exported swift.sh can name it. It is built under a file lock beside it (:func:`build_lock`),
so processes asking at once wait for one build instead of each writing gigabytes.

It is built by the trainer's own interpreter (``python -m autotune.worker.materialise model ...``
run by the swift venv's python through :func:`run_with`), so the files are written by the same
transformers that reads them and autotune's own environment needs no torch. The same entry point
writes the worst-case prompts (``prompts``) with :func:`autotune.worker.data.worst_case_prompts`,
counted by the tokenizer the trainer will use.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "build_lock",
    "cache_base",
    "cache_root",
    "content_key",
    "main",
    "materialise_model",
    "model_dir_for",
    "run_with",
    "write_prompts",
]

#: Bumped when the directory layout changes, so an old cache entry is not reused.
FORMAT = 1
#: The chat markers written into the tokenizer (Qwen's), in id order after the byte alphabet.
QWEN_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHARD_BYTES = 2 << 30
DONE_FILE = ".autotune-materialised"


def cache_base() -> Path:
    """autotune's cache folder (``AUTOTUNE_CACHE_DIR`` moves it, e.g. for tests)."""
    return Path(os.environ.get("AUTOTUNE_CACHE_DIR") or str(Path.home() / ".cache" / "autotune")).expanduser()


def cache_root() -> Path:
    """Where materialised models live."""
    return cache_base() / "swift-models"


def _dtype_name(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def content_key(name: str, config: dict[str, Any], dtype: str, fmt: int = FORMAT) -> str:
    """``<name>-<dtype>-<digest>``: the same config in the same dtype always gets the same name."""
    blob = json.dumps({"config": config, "dtype": dtype, "format": fmt}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-").lower() or "model"
    return f"{slug}-{dtype}-{digest}"


def model_dir_for(name: str, config: dict[str, Any], device: str) -> Path:
    """The cache folder of one card in one dtype: the same config always maps to the same folder."""
    return cache_root() / content_key(name, config, _dtype_name(device))


@contextlib.contextmanager
def build_lock(dest: Path) -> Iterator[None]:
    """Hold ``<dest>.lock`` (an flock) while ``dest`` is built: parallel trials, the ranks of one
    trial and other studies asking for the same cache entry wait for the first builder instead of
    each writing a multi-GB copy at once. The kernel drops the lock when its holder dies."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# -- what runs inside the trainer's interpreter -----------------------------------------------


def _init_value(name: str, shape: tuple[int, ...], std: float) -> Any:
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape)
    return torch.randn(shape) * std


def _write_weights(config_dir: Path, dest: Path, dtype_name: str, seed: int = 0) -> None:
    """Random safetensors for the architecture in ``config_dir``, one shard at a time."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    dtype = getattr(torch, dtype_name)
    # named_parameters() lists a tied embedding once; transformers re-ties it on load
    shapes = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]
    size = dtype.itemsize if hasattr(dtype, "itemsize") else torch.finfo(dtype).bits // 8
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in shapes:
        nbytes = size * int(torch.Size(shape).numel())
        if shards[-1] and used + nbytes > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    torch.manual_seed(seed)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for file, shard in zip(files, shards):
        tensors = {}
        for name, shape in shard:
            tensors[name] = _init_value(name, shape, std).to(dtype).contiguous()
            total += tensors[name].numel() * size
            weight_map[name] = file
        save_file(tensors, str(dest / file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(dest: Path, config: dict[str, Any]) -> None:
    """The byte-level BPE described in the module docstring, saved beside the weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    data = json.loads(core.to_str())
    data["added_tokens"] = [
        {
            "id": len(alphabet) + i,
            "content": marker,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, marker in enumerate(QWEN_MARKERS)
    ]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = int(config.get("max_position_embeddings") or 32768)
    tokenizer.save_pretrained(str(dest))


def materialise_model(config: dict[str, Any], dest: Path, dtype_name: str) -> Path:
    """Write the model directory at ``dest`` whole or not at all (built aside, then renamed)."""
    dest = Path(dest)
    if (dest / DONE_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        shaped = {k: v for k, v in config.items() if not k.startswith("_")}
        shaped["torch_dtype"] = dtype_name
        shaped["dtype"] = dtype_name
        (tmp / "config.json").write_text(json.dumps(shaped, indent=2))
        _write_weights(tmp, tmp, dtype_name)
        _write_tokenizer(tmp, shaped)
        (tmp / DONE_FILE).write_text(json.dumps({"format": FORMAT, "dtype": dtype_name}) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:  # another study published it first: theirs is identical
            if not (dest / DONE_FILE).is_file():
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def write_prompts_here(tokenizer_dir: Path, length: int, count: int, out: Path, seed: int = 0) -> Path:
    """``count`` chat rows whose user turn is exactly ``length`` tokens of the trainer's tokenizer."""
    from autotune.worker.data import worst_case_prompts
    from autotune.worker.tokenizer import load_tokenizer

    tokenizer = load_tokenizer({}, tokenizer_dir)
    prompts = worst_case_prompts(tokenizer, length, count, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")  # parallel trials may ask at once: publish whole
    with open(tmp, "w", encoding="utf-8") as handle:
        for text in prompts:
            handle.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.worker.materialise")
    sub = parser.add_subparsers(dest="what", required=True)
    model = sub.add_parser("model", help="write a card as a model directory")
    model.add_argument("--config", required=True, help="config.json of the card")
    model.add_argument("--dtype", required=True, choices=("float32", "bfloat16"))
    model.add_argument("--out", required=True)
    prompts = sub.add_parser("prompts", help="write worst-case prompts as chat JSON lines")
    prompts.add_argument("--tokenizer", required=True)
    prompts.add_argument("--length", type=int, required=True)
    prompts.add_argument("--count", type=int, required=True)
    prompts.add_argument("--seed", type=int, default=0)
    prompts.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.what == "model":
        config = json.loads(Path(args.config).read_text())
        print(materialise_model(config, Path(args.out), args.dtype))
    else:
        print(write_prompts_here(Path(args.tokenizer), args.length, args.count, Path(args.out), args.seed))
    return 0


# -- what the runner calls, in autotune's own process -----------------------------------------


def run_with(python: str, args: list[str], *, timeout_s: float = 3600.0) -> str:
    """Run this module's :func:`main` under ``python`` (the trainer's interpreter); its stdout.

    Only the ``autotune`` package is put on that interpreter's path (through a folder holding a
    link to it), never the rest of autotune's environment, whose packages would shadow the
    trainer's own. Raises RuntimeError with the last lines of stderr when it fails.
    """
    package = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="autotune-path-") as shim:
        (Path(shim) / "autotune").symlink_to(package, target_is_directory=True)
        env = {**os.environ, "PYTHONPATH": shim, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONHOME", None)
        done = subprocess.run(
            [python, "-m", "autotune.worker.materialise", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{python} -m autotune.worker.materialise {args[0]} failed: {tail}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def ensure_model(python: str, name: str, config: dict[str, Any], device: str) -> Path:
    """The cached model directory of a card, built by ``python`` the first time it is asked for."""
    dest = model_dir_for(name, config, device)
    if (dest / DONE_FILE).is_file():
        return dest
    with build_lock(dest):
        if (dest / DONE_FILE).is_file():  # another process built it while this one waited
            return dest
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=dest.parent, delete=False) as handle:
            json.dump(config, handle)
            config_path = handle.name
        try:
            run_with(
                python, ["model", "--config", config_path, "--dtype", _dtype_name(device), "--out", str(dest)]
            )
        finally:
            Path(config_path).unlink(missing_ok=True)
    return dest


def write_prompts(
    python: str, tokenizer_dir: Path, length: int, count: int, out: Path, seed: int = 0
) -> Path:
    """Worst-case prompts counted by the tokenizer in ``tokenizer_dir``, built by ``python``."""
    run_with(
        python,
        [
            "prompts",
            "--tokenizer",
            str(tokenizer_dir),
            "--length",
            str(int(length)),
            "--count",
            str(int(count)),
            "--seed",
            str(int(seed)),
            "--out",
            str(out),
        ],
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
