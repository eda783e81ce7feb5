"""Model cards and model resolution.

The cards are what a search plans and runs on when the weights are not at hand, so the tests
check them against transformers itself: every card must load as a transformers config, and the
parameter count autotune computes must equal what transformers actually builds (on the meta
device, which allocates nothing, so even a 7-8B model costs milliseconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import UsageError
from autotune.models import (
    ModelSpec,
    known_models,
    load_card,
    resolve_model,
    write_config_dir,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ALL_CARDS = known_models()

EXPECTED_CARDS = {
    "Qwen2.5-0.5B",
    "Qwen2.5-1.5B",
    "Qwen2.5-3B",
    "Qwen2.5-7B",
    "Qwen2.5-14B",
    "Qwen2.5-32B",
    "Qwen3-0.6B",
    "Qwen3-1.7B",
    "Qwen3-4B",
    "Qwen3-8B",
    "Qwen3-14B",
    "Qwen3-32B",
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Llama-3.2-1B",
    "Llama-3.2-3B",
    "tiny-qwen",
    "Qwen2.5-VL-3B",
    "Qwen2.5-VL-7B",
}


@pytest.fixture(autouse=True)
def _empty_hf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point every cache variable at an empty folder so a developer's real cache cannot leak in."""
    empty = tmp_path_factory.mktemp("empty-hf")
    monkeypatch.setenv("HF_HUB_CACHE", str(empty / "hub"))
    monkeypatch.setenv("HF_HOME", str(empty))
    monkeypatch.setenv("XDG_CACHE_HOME", str(empty / "xdg"))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(empty / "home"))


def _build_meta(spec: ModelSpec):
    """The model transformers builds from the config, on the meta device (vision-language models
    through AutoModelForImageTextToText, as TRL loads them)."""
    auto = transformers.AutoModelForImageTextToText if spec.vision else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(spec.transformers_config())


def _real_param_count(spec: ModelSpec) -> int:
    """What transformers builds from the config, tied weights counted once (parameters() dedups)."""
    return sum(p.numel() for p in _build_meta(spec).parameters())


def _largest_module_params(spec: ModelSpec) -> int:
    model = _build_meta(spec)
    return max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())


# -- the cards ------------------------------------------------------------------------------
def test_expected_cards_ship() -> None:
    assert EXPECTED_CARDS <= set(ALL_CARDS)
    # sizes in numeric order, so the list in error messages reads naturally
    sizes = ("0.5B", "1.5B", "3B", "7B", "14B", "32B")
    order = [ALL_CARDS.index(f"Qwen2.5-{size}") for size in sizes]
    assert order == sorted(order)
    assert ALL_CARDS.index("Llama-3.1-8B") < ALL_CARDS.index("Llama-3.1-70B")


@pytest.mark.parametrize("name", ALL_CARDS)
def test_card_is_a_valid_transformers_config(name: str) -> None:
    spec = resolve_model(name)
    assert spec.source == "card" and spec.path is None and not spec.has_weights
    assert "_card" not in spec.config
    cfg = spec.transformers_config()
    assert type(cfg) is type(transformers.AutoConfig.for_model(spec.model_type))
    tied = cfg.tie_word_embeddings
    cfg = cfg.get_text_config()  # the decoder's part (the config itself for text-only models)
    assert cfg.hidden_size == spec.hidden_size
    assert cfg.num_hidden_layers == spec.num_layers
    assert cfg.vocab_size == spec.vocab_size
    assert cfg.num_key_value_heads == spec.num_kv_heads
    assert getattr(cfg, "head_dim", None) in (None, spec.head_dim)
    assert bool(tied) == spec.tied_embeddings


@pytest.mark.parametrize("name", ALL_CARDS)
def test_card_metadata(name: str) -> None:
    spec = load_card(name)
    assert spec is not None
    meta = spec.card
    assert meta["name"] == name
    assert isinstance(meta["aliases"], list)
    assert meta["source"].strip()
    assert meta["params_b"] > 0


@pytest.mark.parametrize("name", ALL_CARDS)
def test_computed_params_match_published(name: str) -> None:
    spec = resolve_model(name)
    published = spec.published_params_b
    assert published is not None
    assert spec.num_params / 1e9 == pytest.approx(published, rel=0.015)


@pytest.mark.parametrize("name", ALL_CARDS)
def test_computed_params_equal_transformers_exactly(name: str) -> None:
    spec = resolve_model(name)
    assert spec.num_params == _real_param_count(spec)


@pytest.mark.parametrize("name", ["tiny-qwen", "Qwen2.5-7B", "Qwen3-8B"])
def test_largest_layer_is_the_embedding(name: str) -> None:
    spec = resolve_model(name)
    assert spec.largest_layer_params == spec.vocab_size * spec.hidden_size
    assert spec.largest_layer_params == _largest_module_params(spec)


def test_known_shapes() -> None:
    """Spot values from the published config.json files (reference.md's Architectures table)."""
    q7 = resolve_model("Qwen2.5-7B")
    assert (q7.hidden_size, q7.intermediate_size, q7.num_layers) == (3584, 18944, 28)
    assert (q7.num_heads, q7.num_kv_heads, q7.head_dim) == (28, 4, 128)
    assert (q7.vocab_size, q7.tied_embeddings, q7.model_type) == (152064, False, "qwen2")

    q05 = resolve_model("Qwen2.5-0.5B")
    assert (q05.hidden_size, q05.num_heads, q05.head_dim, q05.vocab_size) == (896, 14, 64, 151936)
    assert q05.tied_embeddings

    q3 = resolve_model("Qwen3-4B")  # head_dim 128 although hidden / heads = 80
    assert (q3.hidden_size, q3.num_heads, q3.head_dim, q3.model_type) == (2560, 32, 128, "qwen3")

    ll = resolve_model("Llama-3.1-8B")
    assert (ll.hidden_size, ll.intermediate_size, ll.num_kv_heads, ll.vocab_size) == (
        4096,
        14336,
        8,
        128256,
    )
    assert not ll.tied_embeddings


def test_tiny_qwen_shape() -> None:
    spec = resolve_model("tiny-qwen")
    assert spec.model_type == "qwen2"
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (2, 64, 128)
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    assert spec.vocab_size == 151936
    assert spec.tied_embeddings
    assert spec.config["max_position_embeddings"] == 4096


# -- name resolution ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("Qwen2.5-7B", "Qwen2.5-7B"),
        ("qwen2.5-7b", "Qwen2.5-7B"),
        ("Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("QWEN/QWEN2.5-7B-INSTRUCT", "Qwen2.5-7B"),
        ("someone/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),  # a fine-tune keeps its base's shapes
        ("Qwen/Qwen3-8B", "Qwen3-8B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("  tiny-qwen ", "tiny-qwen"),
    ],
)
def test_alias_resolution(given: str, canonical: str) -> None:
    spec = resolve_model(given)
    assert spec.name == canonical
    assert spec.source == "card"


def test_aliases_are_unique_across_cards() -> None:
    seen: dict[str, str] = {}
    for name in ALL_CARDS:
        meta = load_card(name).card  # type: ignore[union-attr]
        for key in [meta["name"], *meta["aliases"]]:
            owner = seen.setdefault(key.lower(), name)
            assert owner == name, f"{key!r} claimed by {owner} and {name}"


def test_unknown_model_error_is_one_line_and_lists_cards() -> None:
    with pytest.raises(UsageError) as info:
        resolve_model("Mistral-7B-v0.3")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown model 'Mistral-7B-v0.3': use a local directory with config.json")
    for name in ALL_CARDS:
        assert name in message


def test_missing_path_is_reported_as_path() -> None:
    with pytest.raises(UsageError, match="no such model directory"):
        resolve_model("./does/not/exist")


# -- local directories ------------------------------------------------------------------------
def _write_checkpoint(directory: Path, config: dict, weights: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if weights:
        (directory / "model.safetensors").write_bytes(b"\0" * 8)
    return directory


def test_local_directory(tmp_path: Path) -> None:
    config = resolve_model("Qwen2.5-0.5B").config
    ckpt = _write_checkpoint(tmp_path / "my-model", config, weights=True)
    spec = resolve_model(str(ckpt))
    assert spec.source == "path"
    assert spec.path == ckpt
    assert spec.name == str(ckpt)
    assert spec.has_weights
    assert spec.num_params == resolve_model("Qwen2.5-0.5B").num_params


def test_local_directory_without_weights(tmp_path: Path) -> None:
    tiny = resolve_model("tiny-qwen").config
    ckpt = _write_checkpoint(tmp_path / "cfg-only", tiny, weights=False)
    spec = resolve_model(str(ckpt))
    assert spec.source == "path" and not spec.has_weights


def test_local_directory_wins_over_card_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory named like a card is the user's checkpoint, not the card."""
    monkeypatch.chdir(tmp_path)
    tiny = dict(resolve_model("tiny-qwen").config)
    _write_checkpoint(tmp_path / "Qwen2.5-7B", tiny, weights=False)
    spec = resolve_model("Qwen2.5-7B")
    assert spec.source == "path"
    assert spec.hidden_size == 64


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError) as info:
        resolve_model(str(tmp_path / "empty"))
    assert "no config.json" in str(info.value)
    assert "\n" not in str(info.value)


# -- the Hugging Face cache -----------------------------------------------------------------
def _fake_cache_entry(cache: Path, repo_id: str, config: dict, weights: bool) -> Path:
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    _write_checkpoint(snapshot, config, weights)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123456789abcdef")
    return snapshot


def test_hf_cache_by_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    tiny = dict(resolve_model("tiny-qwen").config)
    snapshot = _fake_cache_entry(cache, "Qwen/Qwen2.5-7B-Instruct", tiny, weights=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    spec = resolve_model("Qwen/Qwen2.5-7B-Instruct")
    assert spec.source == "hf-cache"
    assert spec.name == "Qwen/Qwen2.5-7B-Instruct"
    assert spec.path == snapshot
    assert spec.has_weights
    assert spec.hidden_size == 64  # the cached config, not the card


def test_hf_cache_via_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    tiny = resolve_model("tiny-qwen").config
    _fake_cache_entry(tmp_path / "hfhome" / "hub", "acme/Tiny", tiny, weights=False)
    spec = resolve_model("acme/Tiny")
    assert spec.source == "hf-cache" and not spec.has_weights
    assert resolve_model("Tiny").name == "acme/Tiny"  # unambiguous bare name


def test_hf_cache_miss_falls_back_to_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    spec = resolve_model("Qwen/Qwen2.5-7B-Instruct")
    assert spec.source == "card" and spec.name == "Qwen2.5-7B"


# -- writing a config directory -----------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen", "Qwen3-8B", "Llama-3.2-1B"])
def test_write_config_dir_round_trips_through_transformers(name: str, tmp_path: Path) -> None:
    spec = resolve_model(name)
    out = write_config_dir(spec, tmp_path / "cfg")
    assert out == tmp_path / "cfg"
    written = json.loads((out / "config.json").read_text())
    assert "_card" not in written
    cfg = transformers.AutoConfig.from_pretrained(str(out))
    assert cfg.model_type == spec.model_type
    assert cfg.hidden_size == spec.hidden_size
    assert cfg.vocab_size == spec.vocab_size
    # and the written directory resolves to the same architecture
    again = resolve_model(str(out))
    assert again.num_params == spec.num_params


def test_tiny_qwen_builds_and_runs_on_cpu(tmp_path: Path) -> None:
    """The tiny card is used for real TRL runs on CPU: it must build and do a forward pass."""
    spec = resolve_model("tiny-qwen")
    cfg = transformers.AutoConfig.from_pretrained(str(write_config_dir(spec, tmp_path)))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, spec.vocab_size, (2, 5))
    logits = model(input_ids=ids).logits
    assert tuple(logits.shape) == (2, 5, 151936)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


# -- vision-language models ---------------------------------------------------------------------
@pytest.mark.parametrize(("name", "out_hidden"), [("Qwen2.5-VL-3B", 2048), ("Qwen2.5-VL-7B", 3584)])
def test_vision_tower_shapes_and_params_equal_transformers(name: str, out_hidden: int) -> None:
    """The tower's shapes from the published config.json, and its parameter count exactly what
    transformers builds (0.67B, reference.md)."""
    spec = resolve_model(name)
    tower = spec.vision
    assert (tower.depth, tower.hidden, tower.intermediate, tower.heads) == (32, 1280, 3420, 16)
    assert (tower.patch_size, tower.spatial_merge_size, tower.temporal_patch_size, tower.out_hidden) == (
        14,
        2,
        2,
        out_hidden,
    )
    visual = _build_meta(spec).model.visual
    assert tower.num_params == sum(p.numel() for p in visual.parameters())
    assert 0.66e9 < tower.num_params < 0.68e9
    assert spec.num_params == spec.text_params + tower.num_params
    linears = [m for m in visual.modules() if isinstance(m, torch.nn.Linear)]
    assert tower.linear_params == sum(m.in_features * m.out_features for m in linears)
    assert tower.patches(256) == 1024


def test_text_only_models_have_no_vision_tower() -> None:
    assert resolve_model("Qwen2.5-3B").vision is None
    assert resolve_model("Qwen2.5-3B").text_params == resolve_model("Qwen2.5-VL-3B").text_params


def test_local_vl_config_keeps_its_vision_tower(tmp_path: Path) -> None:
    spec = resolve_model("Qwen2.5-VL-3B")
    out = write_config_dir(spec, tmp_path / "vl")
    again = resolve_model(str(out))
    assert again.vision == spec.vision and again.num_params == spec.num_params


def test_unknown_vision_tower_is_refused_not_ignored(tmp_path: Path) -> None:
    config = dict(
        resolve_model("Qwen2.5-3B").config, model_type="llava_next", vision_config={"hidden_size": 1024}
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert "vision tower is not modelled" in message and "\n" not in message
