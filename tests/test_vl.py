"""Vision-language models (Qwen2.5-VL): the vision tower in the memory model, and real VL trials.

The per-patch activation count is measured on transformers' own vision block with saved-tensor
hooks, and bitsandbytes' treatment of the tower (quantized like the decoder) on a real tiny model.
The worker's offline processor is checked against transformers' own Qwen2.5-VL processing (prompt
lengths, image tokens, patches), and one real TRL 1.16 VL GRPO trial runs tiny-qwen-vl on CPU.
"""

from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli, saved_activation_bytes

from autotune.candidate.footprint import base_quantization, lora_params, weight_bytes
from autotune.candidate.memory import estimate
from autotune.errors import UsageError
from autotune.models import resolve_model
from autotune.units import GIB

BASE = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=4,
    num_generations=4,
    zero_stage=3,
    offload="none",
    gradient_checkpointing=True,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.5,
    vllm_enable_sleep_mode=True,
    vllm_tensor_parallel_size=1,
)


def vl(params=None, **kw):
    args = dict(gpus=4, capacity_gib=79.3, max_prompt_length=512, max_completion_length=1024)
    args.update(kw)
    return estimate(resolve_model("Qwen2.5-VL-3B"), {**BASE, **(params or {})}, **args)


def test_image_tokens_join_the_prompt_and_the_encoder_shows_in_the_parts():
    text = vl()
    img = vl(image_tokens=1024, images_per_prompt=2)
    assert "vision" not in text.parts and text.vision_gib == 0
    assert img.parts["vision"] == img.vision_gib > 0
    # the LLM sees 2 x 1024 more prompt tokens: exactly a text run with a 2048-token longer prompt
    longer = vl(max_prompt_length=512 + 2048)
    assert img.activations_gib == pytest.approx(longer.activations_gib)
    assert sum(img.parts.values()) == pytest.approx(sum(longer.parts.values()) + img.vision_gib)
    assert any("16384 patches per micro-batch" in note for note in img.notes)  # 2 x 2 x 1024 x 2^2


def test_vision_activations_by_hand():
    """2 completions x 2 images x 1024 tokens x 2^2 merge = 16384 patches; with checkpointing each of
    the 32 blocks keeps 2 x patches x 1280 bytes, plus one block's full activations."""
    tower = resolve_model("Qwen2.5-VL-3B").vision
    patches = 2 * 2 * 1024 * 4
    expected = 2 * patches * 1280 * 32 + patches * (31 * 1280 + 8 * 3420)
    assert vl(image_tokens=1024, images_per_prompt=2).vision_gib * GIB == pytest.approx(expected)
    assert tower.patches(1024) == 4096
    no_gc = vl({"gradient_checkpointing": False}, image_tokens=1024, images_per_prompt=2)
    assert no_gc.vision_gib * GIB == pytest.approx(patches * (31 * 1280 + 8 * 3420) * 32)


def test_vision_scales_with_images_and_micro_batch():
    one = vl(image_tokens=256, images_per_prompt=1).vision_gib
    assert vl(image_tokens=256, images_per_prompt=2).vision_gib == pytest.approx(2 * one)
    assert vl({"per_device_train_batch_size": 4}, image_tokens=256).vision_gib == pytest.approx(2 * one)


def test_vision_params_count_in_states_lora_and_vllm():
    vl3, text3 = resolve_model("Qwen2.5-VL-3B"), resolve_model("Qwen2.5-3B")
    assert vl3.num_params - text3.num_params == vl3.vision.num_params
    assert lora_params(vl3, 8) - lora_params(text3, 8) == sum(
        8 * (i + o) * n for i, o, n in vl3.vision.linear_shapes()
    )
    full_vl = estimate(
        vl3, BASE, gpus=1, capacity_gib=79.3, max_prompt_length=512, max_completion_length=1024
    )
    full_text = estimate(
        text3, BASE, gpus=1, capacity_gib=79.3, max_prompt_length=512, max_completion_length=1024
    )
    assert full_vl.model_states_gib > full_text.model_states_gib


def test_image_tokens_on_a_text_model_are_refused_in_one_line():
    with pytest.raises(UsageError) as info:
        estimate(
            resolve_model("Qwen2.5-3B"),
            BASE,
            gpus=1,
            capacity_gib=79.3,
            max_prompt_length=512,
            max_completion_length=1024,
            image_tokens=1024,
        )
    assert "has no vision tower" in str(info.value) and "\n" not in str(info.value)


def test_vl_without_images_says_how_to_add_them():
    assert any("--image-tokens" in note for note in vl().notes)


def _trl_runner(recipe_factory, **kw):
    from autotune.candidate.space_file import load_space
    from autotune.hardware import find_gpu_type
    from autotune.runners.base import TrialContext
    from autotune.runners.trl import TrlRunner

    recipe = recipe_factory(**{**dict(model="tiny-qwen-vl", gpus=1, runner="trl", device="cpu"), **kw})
    return TrlRunner(
        TrialContext(
            recipe=recipe,
            space=load_space(),
            model=resolve_model(recipe.model),
            gpu=find_gpu_type(recipe.gpu_type),
        )
    )


def test_trl_runner_takes_vl_and_refuses_what_it_cannot_build_in_one_line(recipe_factory, tmp_path):
    runner = _trl_runner(
        recipe_factory, model="Qwen2.5-VL-3B-Instruct", image_tokens=256, images_per_prompt=2
    )
    runner.check_model()
    spec = runner.trial_spec({}, tmp_path, 0)
    assert (spec["image_tokens"], spec["images_per_prompt"]) == (256, 2)
    # 211 is prime: its only grid, 1 x 211, is thinner than Qwen-VL's 1:200 limit
    for kw, words in (
        (dict(image_tokens=211), "no image is exactly 211 tokens"),
        (dict(image_tokens=16, dataset=str(tmp_path / "p.jsonl")), "--dataset"),
    ):
        with pytest.raises(UsageError) as info:
            _trl_runner(recipe_factory, **kw).check_model()
        assert words in str(info.value) and "\n" not in str(info.value)


def test_trl_runner_keeps_a_shape_only_vl_model_off_vllm(recipe_factory, monkeypatch):
    """vLLM builds a VL model's processor from its folder, which a card does not have."""
    import autotune.runners.trl as trl_runner

    monkeypatch.setattr(trl_runner, "installed", lambda package: True)
    runner = _trl_runner(recipe_factory, device="cuda", image_tokens=16)
    assert runner.forced().get("use_vllm") is False
    reasons = [rule({"use_vllm": True, "vllm_mode": "colocate"}) for rule in runner.rules()]
    assert any(r and "vision-language" in r for r in reasons)
    text = _trl_runner(recipe_factory, model="tiny-qwen", device="cuda")
    assert "use_vllm" not in text.forced()


def test_vllm_max_model_length_counts_image_tokens(recipe_factory):
    from autotune.configs.trl import vllm_max_model_length

    recipe = recipe_factory(
        model="Qwen2.5-VL-3B",
        max_prompt_length=512,
        max_completion_length=1024,
        image_tokens=256,
        images_per_prompt=2,
    )
    assert vllm_max_model_length(recipe) == 512 + 512 + 1024


# -- against transformers and bitsandbytes ------------------------------------------------------------
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_vl_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[1],
        ),
    )


@pytest.mark.parametrize(("hidden", "inter"), [(256, 684), (512, 684), (512, 1368)])
def test_vision_block_activation_count_matches_autograd_saved_tensors(hidden, inter):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock

    from autotune.models import VisionTower

    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=1, hidden_size=hidden, intermediate_size=inter, num_heads=4, out_hidden_size=64
        )
    ).vision_config
    config._attn_implementation = "sdpa"
    block = Qwen2_5_VLVisionBlock(config).to(torch.bfloat16)
    patches, head_dim = 512, hidden // 4
    x = torch.randn(patches, hidden, dtype=torch.bfloat16, requires_grad=True)
    rope = (
        torch.randn(patches, head_dim, dtype=torch.bfloat16),
        torch.randn(patches, head_dim, dtype=torch.bfloat16),
    )
    cu_seqlens = torch.tensor([0, 256, 512], dtype=torch.int32)
    total = saved_activation_bytes(block, lambda: block(x, cu_seqlens=cu_seqlens, position_embeddings=rope))
    measured = (total - sum(t.nbytes for t in rope)) / patches
    tower = VisionTower(depth=1, hidden=hidden, intermediate=inter, heads=4, out_hidden=64)
    assert tower.activation_bytes_per_patch() == pytest.approx(measured, rel=0.02)


def test_bitsandbytes_quantizes_the_vision_tower_too(tmp_path):
    """bitsandbytes replaces the vision tower's linears as well (only lm_head stays): the memory
    model's weight bytes for a quantized VL base match what is really allocated."""
    pytest.importorskip("bitsandbytes")
    from autotune.models import ModelSpec

    config = _tiny_vl_config()
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(str(tmp_path / "w"))
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        str(tmp_path / "w"),
        dtype=torch.bfloat16,
        quantization_config={
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
        },
    )
    visual = [
        type(m).__name__
        for n, m in model.named_modules()
        if n.startswith("model.visual") and isinstance(m, torch.nn.Linear)
    ]
    assert visual and set(visual) == {"Linear4bit"}
    real, seen = 0, set()
    for module in model.modules():
        for tensor in list(module.parameters(recurse=False)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                real += tensor.numel() * tensor.element_size()
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            real += state.absmax.numel() * state.absmax.element_size()
            real += state.state2.absmax.numel() * state.state2.absmax.element_size()
    spec = ModelSpec(name="tiny-vl", config=config.to_dict(), source="path", path=None, has_weights=False)
    assert spec.num_params == sum(
        p.numel() for p in transformers.Qwen2_5_VLForConditionalGeneration(config).parameters()
    )
    assert weight_bytes(spec, base_quantization(spec, "4bit", 4)) == pytest.approx(real, rel=0.01)


# -- the worker's offline processor, against transformers' own Qwen2.5-VL processor ------------------
@pytest.mark.parametrize(
    ("tokens", "grid"), [(1, (1, 1)), (16, (4, 4)), (6, (2, 3)), (1024, (32, 32)), (398, (2, 199))]
)
def test_image_grid_is_the_squarest_exact_factorisation(tokens, grid):
    from autotune.worker.vision import image_grid, image_pixels

    assert image_grid(tokens) == grid
    assert image_pixels(resolve_model("Qwen2.5-VL-3B").config, tokens) == (grid[0] * 28, grid[1] * 28)


def test_offline_tokenizer_spells_the_configs_vision_ids():
    from autotune.worker.tokenizer import synthetic_tokenizer

    config = resolve_model("tiny-qwen-vl").config
    tok = synthetic_tokenizer(config)
    for key, name in (
        ("image_token_id", "<|image_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
        ("video_token_id", "<|video_pad|>"),
    ):
        assert tok.convert_tokens_to_ids(name) == config[key]
    ids = tok(text="t5<|vision_start|><|image_pad|><|image_pad|><|vision_end|> t9")["input_ids"]
    assert ids == [5, 151652, 151655, 151655, 151653, 9]
    # an unknown word is one ordinary token, never an image placeholder
    assert tok(text="user")["input_ids"][0] not in {151652, 151653, 151654, 151655, 151656}


@pytest.mark.parametrize(("tokens", "images"), [(16, 2), (6, 1), (64, 1)])
def test_vl_prompts_are_exactly_text_plus_image_tokens(tokens, images):
    """Rendered and tokenised as TRL 1.16 does it (its multimodal messages, the processor's chat
    template, image-token expansion), each prompt is 24 + images x tokens ids, of which exactly
    images x tokens are the image placeholder, and the processor cuts each image into tokens x 4
    patches."""
    from trl.data_utils import prepare_multimodal_messages

    from autotune.worker.tokenizer import synthetic_tokenizer
    from autotune.worker.vision import build_processor, vision_dataset

    config = resolve_model("tiny-qwen-vl").config
    processor = build_processor(synthetic_tokenizer(config), config, tokens)
    data = vision_dataset(processor, config, 24, tokens, images, rows=3, seed=1)
    assert len(data) == 3 and set(data.column_names) == {"prompt", "images"}
    for row in data:
        assert len(row["images"]) == images
        messages = prepare_multimodal_messages(row["prompt"], images=row["images"])
        out = processor.apply_chat_template(
            [messages], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        ids = out["input_ids"][0].tolist()
        assert len(ids) == 24 + images * tokens
        assert ids.count(config["image_token_id"]) == images * tokens
        assert out["pixel_values"].shape[0] == images * tokens * 4
    assert data[0]["prompt"] != data[1]["prompt"]  # fresh text per row, the same sizes


def test_a_prompt_too_short_for_the_markers_is_refused_in_one_line():
    from autotune.worker.tokenizer import synthetic_tokenizer
    from autotune.worker.vision import build_processor, vision_dataset

    config = resolve_model("tiny-qwen-vl").config
    processor = build_processor(synthetic_tokenizer(config), config, 4)
    with pytest.raises(UsageError) as info:
        vision_dataset(processor, config, 5, 4, 2, rows=1)
    assert "cannot hold the chat markers" in str(info.value) and "\n" not in str(info.value)


# -- a real VL GRPO trial through the worker, on CPU ----------------------------------------------------------
VL_PROMPT, VL_COMPLETION, IMAGE_TOKENS, IMAGES = 24, 8, 16, 2


@pytest.mark.slow
def test_real_vl_grpo_trial_on_cpu_trains_text_plus_image_tokens(recipe_factory, tmp_path):
    """tiny-qwen-vl, shape-only, through TRL 1.16's VL path: 2 synthetic images of 16 tokens each
    (112 x 112 px: 8 x 8 patches of 14 px, merged 2 x 2) beside a 24-token text prompt.

    TRL counts the tokens it trains (``num_tokens``: the attention mask of prompt + completion,
    the prompt as its processor tokenised it), so every step's count must be
    samples x (24 + 2 x 16 + 8): the image placeholders reach the language model, and the
    vision tower runs (``pixel_values`` go into the same forward).
    """
    import ast
    import json

    from autotune.trial.launch import launch

    runner = _trl_runner(
        recipe_factory,
        max_prompt_length=VL_PROMPT,
        max_completion_length=VL_COMPLETION,
        image_tokens=IMAGE_TOKENS,
        images_per_prompt=IMAGES,
        warmup_steps=1,
        measure_steps=1,
    )
    runner.check()
    params = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_generations=2,
        gradient_checkpointing=True,
        use_vllm=False,
        zero_stage=0,
        offload="none",
    )
    assert all(rule(params) is None for rule in runner.rules())
    trial_dir = tmp_path / "trial"
    result = launch(
        runner.prepare(params, trial_dir, 0),
        on_line=lambda stream, line: None,
        should_stop=lambda: None,
        trial_timeout_s=240,
        hang_timeout_s=120,
        grace_s=5,
    )
    assert result.returncode == 0, result.stderr_tail[-3000:]

    per_sequence = VL_PROMPT + IMAGES * IMAGE_TOKENS + VL_COMPLETION
    stdout = (trial_dir / "stdout.log").read_text()
    assert f"prompt tokens as the model sees them: {VL_PROMPT + IMAGES * IMAGE_TOKENS} " in stdout
    assert "images 112x112 px" in stdout and "random weights (shape-only" in stdout
    # generation's first micro-batch: 2 completions x 2 images x (16 tokens x 2 x 2 merged patches)
    assert "vision tower: 256 patches of 4 image(s), grid [1, 8, 8] in its first forward" in stdout
    lines = [json.loads(t) for t in (trial_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for line in lines:
        assert line["samples"] == 2 and line["step_time"] > 0 and line["peak_memory_gib"] > 0.1
        assert line["tokens"] == line["samples"] * per_sequence
        assert line["completion_length"] == VL_COMPLETION
    logs = [ast.literal_eval(t) for t in stdout.splitlines() if t.startswith("{'loss'")]
    assert [float(log["num_tokens"]) for log in logs] == [2 * per_sequence * s for s in range(1, 5)]
    print(
        f"VL trial: {per_sequence} tokens/sequence, step times {[m['step_time'] for m in lines]}, "
        f"throughput {2 / lines[-1]['step_time']:.2f} completions/s"
    )


# --- moved from test_review_fixes.py: image flags a runner cannot honour or out of range --------------------


def test_swift_and_sim_searches_with_image_tokens_are_one_line_errors(tmp_path):
    one_line_error(
        run_cli(
            "search",
            "--model",
            "tiny-qwen-vl",
            "--gpus",
            "1",
            "--device",
            "cpu",
            "--runner",
            "swift",
            "--image-tokens",
            "64",
            "--trials",
            "1",
            cwd=tmp_path,
        ),
        "text-only",
    )
    one_line_error(
        run_cli(
            "search",
            "--model",
            "Qwen2.5-VL-3B-Instruct",
            "--gpus",
            "1",
            "--gpu-type",
            "H100-80GB",
            "--runner",
            "sim",
            "--image-tokens",
            "256",
            "--trials",
            "1",
            cwd=tmp_path,
        ),
        "--runner sim",
        "text-only",
    )
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("study.db"))


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--image-tokens", "-3000"], "--image-tokens -3000"),
        (["--image-tokens", "256", "--images-per-prompt", "-2"], "--images-per-prompt -2"),
        (["--image-tokens", "256", "--images-per-prompt", "0"], "--images-per-prompt 0"),
    ],
)
def test_negative_image_flags_are_refused(tmp_path, flags, needle):
    base = ["--model", "Qwen2.5-VL-3B-Instruct", "--gpus", "1", "--gpu-type", "H100-80GB"]
    one_line_error(run_cli("estimate", *base, *flags, cwd=tmp_path), needle)
    one_line_error(run_cli("search", *base, "--runner", "sim", "--trials", "1", *flags, cwd=tmp_path), needle)
