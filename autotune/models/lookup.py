"""Where a model's ``config.json`` comes from: a local directory, the Hugging Face cache, or a
shipped card (``autotune/cards/*.json``), in that order (see :mod:`autotune.models`)."""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.models.spec import ModelSpec

__all__ = ["known_models", "load_card", "resolve_model", "write_config_dir"]

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


# -- cards ---------------------------------------------------------------------------------
def _card_files() -> list[Any]:
    folder = resources.files("autotune").joinpath("cards")
    return sorted(
        (entry for entry in folder.iterdir() if entry.name.endswith(".json")),
        key=lambda entry: entry.name,
    )


def _load_cards() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every shipped card as (metadata, config); read on each call, the files are small."""
    cards = []
    for entry in _card_files():
        data = json.loads(entry.read_text(encoding="utf-8"))
        meta = data.pop("_card")
        cards.append((meta, data))
    return cards


def _natural_key(name: str) -> list[Any]:
    """Sort key that orders embedded numbers by value: 0.5B, 1.5B, 3B, 7B, 14B, 32B."""
    parts = re.split(r"(\d+)", name.lower())
    return [int(part) if i % 2 else part for i, part in enumerate(parts)]


def known_models() -> list[str]:
    """Canonical names of the shipped cards, sorted (numbers by value), for help and errors."""
    return sorted((meta["name"] for meta, _ in _load_cards()), key=_natural_key)


def _card_keys(meta: dict[str, Any]) -> set[str]:
    keys = {meta["name"], *meta.get("aliases", [])}
    return {key.lower() for key in keys}


def load_card(name: str) -> ModelSpec | None:
    """The card whose name or alias matches ``name`` (case-insensitive), or None.

    ``Org/Name`` also matches a card listing only ``Name``, so ``someorg/Qwen2.5-7B-Instruct``
    finds the Qwen2.5-7B shapes; fine-tunes keep their base model's architecture.
    """
    wanted = name.strip().lower()
    candidates = [wanted]
    if "/" in wanted:
        candidates.append(wanted.rsplit("/", 1)[1])
    cards = _load_cards()
    for candidate in candidates:
        for meta, config in cards:
            if candidate in _card_keys(meta):
                return ModelSpec(
                    name=meta["name"],
                    config=config,
                    source="card",
                    path=None,
                    has_weights=False,
                    card=meta,
                )
    return None


# -- local files ---------------------------------------------------------------------------
def _has_weights(directory: Path) -> bool:
    for pattern in _WEIGHT_PATTERNS:
        for candidate in directory.glob(pattern):
            if candidate.exists():  # cache snapshots hold symlinks; a dangling one is no weight
                return True
    return False


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{config_path} is not a JSON object")
    data.pop("_card", None)
    return data


def _from_directory(directory: Path, given: str) -> ModelSpec:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UsageError(
            f"directory {directory} has no config.json: point at a Hugging Face model directory "
            "(the one holding config.json) or use a model name"
        )
    return ModelSpec(
        name=given,
        config=_read_config(config_path),
        source="path",
        path=directory,
        has_weights=_has_weights(directory),
    )


def _hub_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloads, most specific setting first."""
    dirs: list[Path] = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]).expanduser())
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _best_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` points at, else the newest one holding config.json."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text(encoding="utf-8").strip()
        if (pinned / "config.json").is_file():
            return pinned
    found = [p for p in snapshots.glob("*") if (p / "config.json").is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (p / "config.json").stat().st_mtime)


def _from_hf_cache(name: str) -> ModelSpec | None:
    """A model downloaded earlier, by ``Org/Name`` id or, when unambiguous, by bare ``Name``."""
    name = name.strip()
    if not name or name.count("/") > 1:
        return None
    for cache in _hub_cache_dirs():
        if not cache.is_dir():
            continue
        if "/" in name:
            org, repo = name.split("/")
            repo_dirs = [cache / f"models--{org}--{repo}"]
            if not repo_dirs[0].is_dir():  # hub ids are case-insensitive
                want = f"models--{org}--{repo}".lower()
                repo_dirs = [p for p in cache.glob("models--*") if p.name.lower() == want]
        else:
            want = f"--{name}".lower()
            repo_dirs = [p for p in cache.glob("models--*--*") if p.name.lower().endswith(want)]
            if len(repo_dirs) != 1:
                continue
        for repo_dir in repo_dirs:
            snapshot = _best_snapshot(repo_dir)
            if snapshot is None:
                continue
            repo_id = repo_dir.name[len("models--") :].replace("--", "/", 1)
            return ModelSpec(
                name=repo_id,
                config=_read_config(snapshot / "config.json"),
                source="hf-cache",
                path=snapshot,
                has_weights=_has_weights(snapshot),
            )
    return None


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~", ".\\")) or text in {".", ".."}


def _checked(spec: ModelSpec) -> ModelSpec:
    """``spec`` once its vision tower and quantization are known to be countable: a config autotune
    cannot count fully is refused here (one line), never planned on with a part left out."""
    _ = (spec.vision, spec.quantization)
    return spec


def resolve_model(name_or_path: str) -> ModelSpec:
    """Find a model's config: local directory, then the HF cache, then a shipped card.

    Raises :class:`UsageError` (one line) when nothing matches, listing the shipped cards.
    """
    given = str(name_or_path).strip()
    if not given:
        raise UsageError("no model given: pass a local directory, a Hugging Face id, or a card name")
    candidate = Path(given).expanduser()
    if candidate.is_dir():
        return _checked(_from_directory(candidate, given))
    if candidate.is_file() and candidate.name == "config.json":
        return _checked(_from_directory(candidate.parent, given))
    if _looks_like_path(given):
        raise UsageError(f"no such model directory: {given}")

    cached = _from_hf_cache(given)
    if cached is not None:
        return _checked(cached)
    card = load_card(given)
    if card is not None:
        return card
    raise UsageError(
        f"unknown model {given!r}: use a local directory with config.json, a model in the local "
        f"Hugging Face cache, or one of: {', '.join(known_models())}"
    )


def write_config_dir(spec: ModelSpec, dest: Path) -> Path:
    """Write ``spec``'s config.json into ``dest`` (created if needed) and return ``dest``.

    Trials build a random-weight model from this directory with
    ``AutoConfig.from_pretrained(dest)`` + ``AutoModelForCausalLM.from_config``, in a
    subprocess that must not need the network or the original checkpoint.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in spec.config.items() if k != "_card"}
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (dest / "config.json").write_text(text, encoding="utf-8")
    return dest
