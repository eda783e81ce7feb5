"""Vision-language models (Qwen2.5-VL): the vision tower in the memory model and the runner's refusal.

The per-patch activation count is measured on transformers' own vision block with saved-tensor
hooks, and bitsandbytes' treatment of the tower (quantized like the decoder) on a real tiny model.
"""

from __future__ import annotations

import pytest

from autotune.errors import UsageError
from autotune.models import resolve_model
from autotune.search.memory import estimate, lora_params, weight_bytes, base_quantization
from autotune.units import GIB

BASE = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_generations=4, zero_stage=3,
            offload="none", gradient_checkpointing=True, use_vllm=True, vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.5, vllm_enable_sleep_mode=True, vllm_tensor_parallel_size=1)


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
    assert any("16384 patches per micro-batch" in note for note in img.notes)   # 2 x 2 x 1024 x 2^2


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
    assert lora_params(vl3, 8) - lora_params(text3, 8) == sum(8 * (i + o) * n for i, o, n in vl3.vision.linear_shapes())
    full_vl = estimate(vl3, BASE, gpus=1, capacity_gib=79.3, max_prompt_length=512, max_completion_length=1024)
    full_text = estimate(text3, BASE, gpus=1, capacity_gib=79.3, max_prompt_length=512, max_completion_length=1024)
    assert full_vl.model_states_gib > full_text.model_states_gib


def test_image_tokens_on_a_text_model_are_refused_in_one_line():
    with pytest.raises(UsageError) as info:
        estimate(resolve_model("Qwen2.5-3B"), BASE, gpus=1, capacity_gib=79.3, max_prompt_length=512,
                 max_completion_length=1024, image_tokens=1024)
    assert "has no vision tower" in str(info.value) and "\n" not in str(info.value)


def test_vl_without_images_says_how_to_add_them():
    assert any("--image-tokens" in note for note in vl().notes)


def test_trl_runner_refuses_vl_in_one_line(recipe_factory):
    from autotune.hardware import find_gpu_type
    from autotune.runners.base import TrialContext
    from autotune.runners.trl import TrlRunner
    from autotune.search.space import load_space

    recipe = recipe_factory(model="Qwen2.5-VL-3B-Instruct", gpus=1, runner="trl", device="cpu", image_tokens=256)
    runner = TrlRunner(TrialContext(recipe=recipe, space=load_space(), model=resolve_model(recipe.model),
                                    gpu=find_gpu_type(recipe.gpu_type)))
    with pytest.raises(UsageError) as info:
        runner.check_model()
    assert "vision-language" in str(info.value) and "\n" not in str(info.value)


def test_vllm_max_model_length_counts_image_tokens(recipe_factory):
    from autotune.configs.trl import vllm_max_model_length

    recipe = recipe_factory(model="Qwen2.5-VL-3B", max_prompt_length=512, max_completion_length=1024,
                            image_tokens=256, images_per_prompt=2)
    assert vllm_max_model_length(recipe) == 512 + 512 + 1024


# -- against transformers and bitsandbytes ------------------------------------------------------------
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_vl_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1]))


@pytest.mark.parametrize(("hidden", "inter"), [(256, 684), (512, 684), (512, 1368)])
def test_vision_block_activation_count_matches_autograd_saved_tensors(hidden, inter):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock

    from autotune.models import VisionTower

    config = transformers.Qwen2_5_VLConfig(vision_config=dict(depth=1, hidden_size=hidden, intermediate_size=inter,
                                                              num_heads=4, out_hidden_size=64)).vision_config
    config._attn_implementation = "sdpa"
    block = Qwen2_5_VLVisionBlock(config).to(torch.bfloat16)
    params = {p.data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.dtype.is_floating_point:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    patches, head_dim = 512, hidden // 4
    x = torch.randn(patches, hidden, dtype=torch.bfloat16, requires_grad=True)
    rope = (torch.randn(patches, head_dim, dtype=torch.bfloat16), torch.randn(patches, head_dim, dtype=torch.bfloat16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cu_seqlens=torch.tensor([0, 256, 512], dtype=torch.int32), position_embeddings=rope)
    measured = (sum(saved.values()) - sum(t.nbytes for t in rope)) / patches
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
        str(tmp_path / "w"), dtype=torch.bfloat16,
        quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                             "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"})
    visual = [type(m).__name__ for n, m in model.named_modules() if n.startswith("model.visual") and
              isinstance(m, torch.nn.Linear)]
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
    assert spec.num_params == sum(p.numel() for p in transformers.Qwen2_5_VLForConditionalGeneration(config).parameters())
    assert weight_bytes(spec, base_quantization(spec, "4bit", 4)) == pytest.approx(real, rel=0.01)
