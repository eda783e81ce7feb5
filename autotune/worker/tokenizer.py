"""A tokenizer for any model, offline.

A trial needs a tokenizer (TRL tokenizes the prompts and decodes the completions), but a search
usually runs on shapes alone: a shipped card or a ``config.json`` without the tokenizer files, on
a machine that may not reach the Hub. Memory and speed depend on how many tokens there are and on
the vocabulary size (the logits), never on which tokens they are, so when the model's own
tokenizer is not on disk we build one in-process:

* one word-level token per id, ``t0`` .. ``t{V-1}``, covering the model's FULL vocabulary, so any
  id the random model samples decodes, and prompts can be written token by token;
* whitespace splitting, no normaliser, no BOS/EOS added: ``"t5 t17 t99"`` is exactly 3 tokens,
  which is what lets :mod:`autotune.worker.data` make prompts of exactly ``max_prompt_length``
  tokens;
* the config's ``eos_token_id`` / ``pad_token_id`` / ``bos_token_id`` named as the special tokens,
  so TRL's EOS handling and padding see the ids the model itself would use;
* for a vision-language config, its vision ids spelled as Qwen2.5-VL's processor names them
  (``<|image_pad|>``, ``<|vision_start|>``, ...; :data:`VISION_TOKENS`), as special tokens, so the
  processor's image-token expansion lands on the ids the model looks for.

Building it is a dict of V strings handed to the Rust ``tokenizers`` library: well under a second
for Qwen's 151,936 ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "SYNTHETIC_PREFIX",
    "VISION_TOKENS",
    "has_tokenizer_files",
    "load_tokenizer",
    "synthetic_tokenizer",
    "token_word",
]

#: Synthetic token ``i`` is spelled ``f"{SYNTHETIC_PREFIX}{i}"``.
SYNTHETIC_PREFIX = "t"

#: Qwen2.5-VL's names for the vision ids its config declares (config key -> token).
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}

#: Files whose presence means a directory carries its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def token_word(token_id: int) -> str:
    """The synthetic tokenizer's spelling of one id."""
    return f"{SYNTHETIC_PREFIX}{token_id}"


def has_tokenizer_files(directory: Path | str | None) -> bool:
    """Whether ``directory`` holds a tokenizer that ``AutoTokenizer`` can load without the network."""
    if directory is None:
        return False
    folder = Path(directory)
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def _first_id(value: Any) -> int | None:
    """Configs give special ids as an int, a list of ints (Llama-3 instruct eos) or null."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep vocab_size and the special ids under ``text_config``; prefer top level."""
    text = config.get("text_config")
    if isinstance(text, dict):
        return {**text, **{k: v for k, v in config.items() if v is not None}}
    return config


def _named_ids(config: dict[str, Any], vocab_size: int) -> dict[int, str]:
    """The vision ids a VL config declares, spelled as the model's processor expects them.

    Qwen2.5-VL's processor finds the image placeholder by name (``<|image_pad|>``) and the model
    finds it by id (``image_token_id``), so the synthetic tokenizer gives those ids those names;
    every other id stays ``t{i}``. Empty for a text-only config.
    """
    if not config.get("vision_config"):
        return {}
    named: dict[int, str] = {}
    for key, name in VISION_TOKENS.items():
        value = _first_id(config.get(key))
        if value is not None and 0 <= value < vocab_size:
            named[value] = name
    return named


def synthetic_tokenizer(config: dict[str, Any]) -> Any:
    """A fast tokenizer with one word per id of ``config``'s vocabulary (see the module docstring).

    Special ids come from the config; missing ones default to the last id, which a random model
    is as unlikely to sample as any other.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    text = _text_config(config)
    vocab_size = int(text["vocab_size"])
    eos_id = _first_id(text.get("eos_token_id"))
    if eos_id is None or not 0 <= eos_id < vocab_size:
        eos_id = vocab_size - 1
    pad_id = _first_id(text.get("pad_token_id"))
    if pad_id is None or not 0 <= pad_id < vocab_size:
        pad_id = eos_id
    bos_id = _first_id(text.get("bos_token_id"))
    if bos_id is not None and not 0 <= bos_id < vocab_size:
        bos_id = None

    named = _named_ids(config, vocab_size)
    vocab = {named.get(i, token_word(i)): i for i in range(vocab_size)}
    # Words outside the vocabulary (a user's dataset read with this tokenizer) count as one token
    # each, mapped to the first ordinary id: the length is what a trial measures, and an EOS or pad
    # id (or an image placeholder) inside a prompt could be masked out somewhere and shorten it.
    unk_id = next(i for i in range(vocab_size) if i not in {eos_id, pad_id, bos_id, *named})
    core = Tokenizer(WordLevel(vocab, unk_token=token_word(unk_id)))
    core.pre_tokenizer = WhitespaceSplit()
    special = {
        "eos_token": token_word(eos_id),
        "pad_token": token_word(pad_id),
        "unk_token": token_word(unk_id),
    }
    if bos_id is not None:
        special["bos_token"] = token_word(bos_id)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **special)
    if named:
        # special, so they are split out of text with no spaces around them, as Qwen's template writes them
        tokenizer.add_special_tokens({"additional_special_tokens": sorted(named.values())})
    # TRL pads prompts on the left for generation; say so rather than rely on its override.
    tokenizer.padding_side = "left"
    tokenizer.model_max_length = int(text.get("max_position_embeddings") or 1 << 30)
    return tokenizer


#: Classes that mean "exactly what tokenizer.json says", with no model-specific rebuilding.
_GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _load_own(path: Path) -> Any:
    """A directory's tokenizer, honouring a generic fast class declared in tokenizer_config.json.

    transformers 5 overrides the declared class for some model types (``qwen2`` is on its
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS list) and rebuilds e.g. ``Qwen2Tokenizer`` from the
    vocabulary with its own pre-tokenizer; a generic tokenizer.json (a word-level one, like ours)
    then encodes every text to zero tokens. A generic class is loaded as declared.
    """
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    declared = None
    config_file = path / "tokenizer_config.json"
    if config_file.is_file() and (path / "tokenizer.json").is_file():
        try:
            declared = json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
        except (OSError, ValueError):
            declared = None
    if declared in _GENERIC_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_tokenizer(config: dict[str, Any], path: Path | str | None = None) -> Any:
    """The model's own tokenizer when ``path`` holds one, else :func:`synthetic_tokenizer`.

    The model's own is loaded with ``local_files_only`` so a trial never waits on the network;
    a tokenizer without a pad token gets its EOS as pad, as TRL would do.
    """
    if has_tokenizer_files(path):
        tokenizer = _load_own(Path(path))  # type: ignore[arg-type]
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    return synthetic_tokenizer(config)
