"""Trial prompts, worst case on purpose.

A trial has to meet the largest memory the real run can meet, and GRPO's memory grows with the
sequence: the KV cache while generating, activations and the ``batch x length x vocab`` logits
while training. So every trial prompt is exactly ``max_prompt_length`` tokens (TRL 1.x no longer
truncates prompts itself) and the worker keeps completions running to ``max_completion_length``.

Lengths are counted the way TRL 1.16 counts them for plain-text prompts,
``processing_class(text=prompts)["input_ids"]`` (special tokens included), so a tokenizer that adds
a BOS still yields prompts of exactly the asked length.

With the synthetic tokenizer (:mod:`autotune.worker.tokenizer`) a prompt is simply ``length``
random ordinary token words. With a real tokenizer, or for a user's ``--dataset file.jsonl``, the
text is cut or padded with a one-token filler until it tokenizes to the exact length.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.worker.tokenizer import SYNTHETIC_PREFIX, token_word

__all__ = [
    "build_dataset",
    "fit_prompt",
    "is_synthetic",
    "one_token_filler",
    "ordinary_ids",
    "prompt_length",
    "prompts_needed",
    "read_prompts",
    "worst_case_prompts",
]

#: Candidate fillers for real tokenizers: each should add exactly one token per repetition.
_FILLERS = (" x", " a", " the", " 0", ".", "!", " hello")


def prompt_length(tokenizer: Any, text: str) -> int:
    """Tokens TRL will feed for ``text`` as a plain-text prompt (special tokens included)."""
    return len(tokenizer(text=text)["input_ids"])


def prompts_needed(completions_per_step: int, num_generations: int, steps: int) -> int:
    """Dataset rows for ``steps`` optimizer steps, plus one step of margin.

    Each optimizer step trains ``completions_per_step`` completions, ``num_generations`` per prompt;
    TRL's RepeatSampler drops incomplete prompt groups, so a short dataset would silently end the
    epoch early (and the Trainer would start another, re-timing the dataloader).
    """
    per_step = math.ceil(completions_per_step / max(num_generations, 1))
    return max(per_step * (steps + 1), 1)


def is_synthetic(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is autotune's word-level one (one token per ``t{i}`` word)."""
    vocab = getattr(tokenizer, "vocab_size", 0)
    return vocab > 0 and tokenizer.convert_ids_to_tokens(vocab - 1) == token_word(vocab - 1)


def ordinary_ids(tokenizer: Any) -> list[int]:
    """Ids a worst-case prompt may use: no special token (EOS, pad, an image placeholder) that
    TRL or the processor would treat differently."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(min(tokenizer.vocab_size, 4096)) if i not in special]


def one_token_filler(tokenizer: Any) -> str:
    """A string that adds exactly one token each time it is appended, for this tokenizer."""
    for candidate in _FILLERS:
        base = prompt_length(tokenizer, "")
        if all(prompt_length(tokenizer, candidate * k) == base + k for k in (1, 2, 3, 7)):
            return candidate
    raise UsageError(
        "cannot find a one-token filler for this tokenizer to make prompts of an exact length; "
        "remove the tokenizer files to use autotune's synthetic tokenizer"
    )


def _cut(tokenizer: Any, text: str, drop: int) -> str:
    """``text`` without its last ``drop`` tokens.

    Fast tokenizers give character offsets, so the cut keeps the user's text verbatim; slow ones
    round-trip through decode, which is exact only when decode inverts encode.
    """
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text=text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        keep = max(len(offsets) - drop, 0)
        return text[: offsets[keep - 1][1]] if keep else ""
    content = tokenizer(text=text, add_special_tokens=False)["input_ids"]
    keep = max(len(content) - drop, 0)
    return tokenizer.decode(content[:keep], skip_special_tokens=False)


def fit_prompt(tokenizer: Any, text: str, length: int, filler: str | None = None) -> str:
    """``text`` cut or padded so that it tokenizes to exactly ``length`` tokens.

    BPE merges at the cut or the join can shift the count by a token, so this converges in a few
    rounds rather than in one; a tokenizer on which it cannot is reported, not silently accepted.
    """
    if length < 1:
        raise UsageError(f"max_prompt_length must be at least 1 (got {length})")
    filler = filler or one_token_filler(tokenizer)
    for _ in range(16):
        count = prompt_length(tokenizer, text)
        if count == length:
            return text
        if count < length:
            text = text + filler * (length - count)
            continue
        text = _cut(tokenizer, text, count - length)
    raise UsageError(f"could not make a prompt of exactly {length} tokens with this tokenizer")


def worst_case_prompts(tokenizer: Any, length: int, count: int, seed: int = 0) -> list[str]:
    """``count`` prompts of exactly ``length`` tokens (random ordinary tokens when synthetic)."""
    rng = random.Random(seed)
    if is_synthetic(tokenizer):
        ids = ordinary_ids(tokenizer)
        return [" ".join(token_word(rng.choice(ids)) for _ in range(length)) for _ in range(count)]
    filler = one_token_filler(tokenizer)
    one = fit_prompt(tokenizer, "", length, filler)
    return [one] * count


def _prompt_text(value: Any, where: str) -> str:
    """A prompt cell as plain text: a string, or a chat (list of messages) with contents joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        parts = []
        for message in value:
            content = message.get("content", "")
            if isinstance(content, list):  # content blocks: keep the text ones
                content = " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
            parts.append(str(content))
        return "\n".join(parts)
    raise UsageError(f"{where}: 'prompt' must be a string or a list of chat messages")


def read_prompts(path: Path | str) -> list[str]:
    """The ``prompt`` column of a JSON-lines file, as plain text (chat prompts are flattened)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise UsageError(f"{path}:{number}: each line needs a 'prompt' field")
        prompts.append(_prompt_text(row["prompt"], f"{path}:{number}"))
    if not prompts:
        raise UsageError(f"dataset {path} has no rows")
    return prompts


def _synthetic_fit(text: str, length: int) -> str:
    """A user's prompt for the synthetic tokenizer: its words, cut or repeated to ``length``.

    Every whitespace-separated word is one token there, so the exact length is a word count.
    """
    words = text.split() or [f"{SYNTHETIC_PREFIX}0"]
    reps = math.ceil(length / len(words))
    return " ".join((words * reps)[:length])


def build_dataset(
    tokenizer: Any, length: int, rows: int, dataset: Path | str | None = None, seed: int = 0
) -> Any:
    """A ``datasets.Dataset`` with a ``prompt`` column: ``rows`` prompts of exactly ``length`` tokens.

    A user dataset is cycled when it has fewer rows than needed, so a small sample file still
    fills every generation batch.
    """
    from datasets import Dataset

    if dataset is None:
        prompts = worst_case_prompts(tokenizer, length, rows, seed)
    else:
        source = read_prompts(dataset)
        chosen = [source[i % len(source)] for i in range(rows)]
        if is_synthetic(tokenizer):
            prompts = [_synthetic_fit(text, length) for text in chosen]
        else:
            filler = one_token_filler(tokenizer)
            cache: dict[str, str] = {}
            prompts = []
            for text in chosen:
                if text not in cache:
                    cache[text] = fit_prompt(tokenizer, text, length, filler)
                prompts.append(cache[text])
    return Dataset.from_dict({"prompt": prompts})
