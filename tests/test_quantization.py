"""Quantized bases: the memory model's weight bytes, the refusals, the export, and a real QLoRA trial.

The byte counts are checked against what bitsandbytes and transformers really allocate (a tiny
model loaded with ``quantization_config`` on the CPU), and the trial is a real TRL GRPO run on a
bitsandbytes NF4 base: bitsandbytes 0.50 runs 4-bit and int8 layers forward and backward on the
CPU with torch 2.13.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from autotune.candidate.footprint import (
    base_quantization,
    dequant_workspace_bytes,
    vllm_weight_bytes,
    weight_bytes,
)
from autotune.candidate.memory import estimate
from autotune.errors import UsageError
from autotune.models import ModelSpec, Quantization, resolve_model
from autotune.units import GIB

#: Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4's quantization_config (as the checkpoint ships it).
GPTQ_INT4 = {
    "bits": 4,
    "group_size": 128,
    "damp_percent": 0.01,
    "desc_act": False,
    "quant_method": "gptq",
    "static_groups": False,
    "sym": True,
    "true_sequential": True,
}


def gptq_7b() -> ModelSpec:
    base = resolve_model("Qwen2.5-7B")
    return ModelSpec(
        name="Qwen2.5-7B-Instruct-GPTQ-Int4",
        config=dict(base.config, quantization_config=GPTQ_INT4),
        source="path",
        path=None,
        has_weights=False,
    )


PARAMS = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=1,
    num_generations=2,
    zero_stage=0,
    offload="none",
    gradient_checkpointing=True,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.2,
    vllm_enable_sleep_mode=False,
    vllm_tensor_parallel_size=1,
)


def test_gptq_checkpoint_is_read_from_config_json():
    quant = gptq_7b().quantization
    assert quant == Quantization("gptq", 4, 128, origin="checkpoint")
    assert resolve_model("Qwen2.5-7B").quantization is None


def test_gptq_weight_bytes_by_hand():
    """Qwen2.5-7B GPTQ int4 g128: decoder linears at 4 bits + fp16 scales + 4-bit zeros per 128
    inputs + int32 g_idx; embeddings, lm_head, norms and biases in bf16."""
    model = gptq_7b()
    quant = model.quantization
    linear = sum(i * o * n for i, o, n in model.decoder_linear_shapes())
    per_weight = 0.5 + 2 / 128 + 0.5 / 128
    g_idx = sum(4 * i * n for i, _, n in model.decoder_linear_shapes())
    expected = linear * per_weight + g_idx + 2 * (model.num_params - linear)
    assert weight_bytes(model, quant) == pytest.approx(expected, rel=1e-9)
    assert 5.0 < weight_bytes(model, quant) / GIB < 5.5  # vs 14.2 GiB in bf16
    # vLLM loads a GPTQ checkpoint as stored
    assert vllm_weight_bytes(model, quant, 1) == weight_bytes(model, quant)


def test_write_up_001_fits_with_room_for_the_kv_cache():
    """shared/seeds/001: GPTQ-int4 Qwen2.5-7B, QLoRA, 2 x A100-40GB, vLLM colocate at 0.2 with
    max_model_len 2500, batch 2, 2 generations: it trained. Before quantization was modelled the
    estimate counted 14.8 GiB of bf16 states and said not one 2500-token sequence fits vLLM."""
    est = estimate(
        gptq_7b(),
        PARAMS,
        gpus=2,
        capacity_gib=39.4,
        max_prompt_length=500,
        max_completion_length=2000,
        lora_rank=16,
    )
    assert est.fits and est.vllm_problem is None
    assert est.model_states_gib < 6.5
    assert est.vllm_gib == pytest.approx(0.2 * 39.4)
    assert est.quantization == "GPTQ int4, group 128"
    assert any("base weights GPTQ int4" in note for note in est.notes)


def test_bitsandbytes_4bit_flag_shrinks_the_states_and_vllm_loads_4bit():
    model = resolve_model("Qwen2.5-7B")
    plain = estimate(
        model,
        PARAMS,
        gpus=1,
        capacity_gib=79.3,
        max_prompt_length=512,
        max_completion_length=1024,
        lora_rank=16,
    )
    nf4 = estimate(
        model,
        PARAMS,
        gpus=1,
        capacity_gib=79.3,
        max_prompt_length=512,
        max_completion_length=1024,
        lora_rank=16,
        quantization="4bit",
    )
    assert plain.model_states_gib - nf4.model_states_gib > 8
    quant = base_quantization(model, "4bit", 16)
    assert quant.method == "nf4" and quant.double_quant
    # bitsandbytes also quantizes... nothing but linears; vLLM's in-flight 4-bit has no double quant
    assert weight_bytes(model, quant) < vllm_weight_bytes(model, quant, 1) < 2 * model.num_params
    assert dequant_workspace_bytes(model, quant) == 2 * 2 * 3584 * 18944


def test_8bit_with_colocated_vllm_is_refused_like_trl():
    est = estimate(
        resolve_model("Qwen2.5-7B"),
        PARAMS,
        gpus=1,
        capacity_gib=79.3,
        max_prompt_length=512,
        max_completion_length=1024,
        lora_rank=16,
        quantization="8bit",
    )
    assert not est.fits and est.vllm_problem == "invalid"
    assert any("in-flight 8-bit" in note for note in est.notes)


@pytest.mark.parametrize(
    ("model", "flag", "lora", "needle"),
    [
        (resolve_model("Qwen2.5-7B"), "4bit", None, "add --lora-rank"),
        (gptq_7b(), None, None, "add --lora-rank"),
        (gptq_7b(), "4bit", 16, "already quantized"),
        (resolve_model("Qwen2.5-7B"), "2bit", 16, "use 4bit"),
    ],
)
def test_refusals_are_one_line(model, flag, lora, needle):
    with pytest.raises(UsageError) as info:
        base_quantization(model, flag, lora)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_unknown_quant_method_is_refused_not_ignored():
    base = resolve_model("Qwen2.5-7B")
    odd = ModelSpec(
        name="fp8",
        config=dict(base.config, quantization_config={"quant_method": "fp8"}),
        source="path",
        path=None,
        has_weights=False,
    )
    with pytest.raises(UsageError, match="not modelled"):
        _ = odd.quantization


# -- against the real libraries ------------------------------------------------------------------
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")


def _tiny_saved(tmp_path):
    from autotune.models import write_config_dir

    spec = resolve_model("tiny-qwen")
    spec = ModelSpec(
        name="tiny",
        config=dict(spec.config, vocab_size=512, intermediate_size=256),
        source="card",
        path=None,
        has_weights=False,
    )
    cfg = transformers.AutoConfig.from_pretrained(str(write_config_dir(spec, tmp_path / "cfg")))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "w"))
    return spec, tmp_path / "w"


@pytest.mark.parametrize("flag", ["4bit", "8bit"])
def test_weight_bytes_equal_what_bitsandbytes_allocates(tmp_path, flag):
    """Load a tiny model quantized on the CPU and add up every tensor it holds, quantization
    state (absmax, nested absmax, SCB) included: the memory model must match it."""
    from autotune.configs.trl import quantization_config
    from autotune.recipe import Recipe

    spec, path = _tiny_saved(tmp_path)
    recipe = Recipe(model="tiny", gpus=1, device="cpu", quantization=flag, lora_rank=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, quantization_config=quantization_config(recipe)
    )
    real, seen = 0, set()
    for module in model.modules():
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if id(tensor) not in seen:  # tied embeddings: one tensor, two modules
                seen.add(id(tensor))
                real += tensor.numel() * tensor.element_size()
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            real += state.absmax.numel() * state.absmax.element_size()
            if state.nested:
                real += state.state2.absmax.numel() * state.state2.absmax.element_size()
        if getattr(weight, "SCB", None) is not None:
            real += weight.SCB.numel() * weight.SCB.element_size()
    quant = base_quantization(spec, flag, 4)
    assert weight_bytes(spec, quant) == pytest.approx(real, rel=0.01)


def test_export_carries_bitsandbytes_config_that_trl_loads(tmp_path):
    """grpo_config.yaml's model_init_kwargs, read back by TRL's own loader, give a 4-bit model."""
    from trl import GRPOConfig
    from trl.trainer.utils import create_model_from_path

    from autotune.export.trl import grpo_yaml
    from autotune.recipe import Recipe
    from autotune.study.record import TrialRow

    _, path = _tiny_saved(tmp_path)
    recipe = Recipe(model="tiny", gpus=1, gpu_type="A100-80GB", quantization="4bit", lora_rank=8)
    params = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=2)
    best = TrialRow(number=3, params=params, status="ok", oom_kind=None, throughput=1.0, peak_memory_gib=10.0)
    text = grpo_yaml(params, recipe, best)
    assert "bitsandbytes" in text
    kwargs = yaml.safe_load(text)
    init = kwargs["model_init_kwargs"]
    assert init["quantization_config"]["load_in_4bit"] and init["dtype"] == "bfloat16"
    config = GRPOConfig(
        output_dir=str(tmp_path / "o"),
        use_cpu=True,
        bf16=False,
        **{k: v for k, v in kwargs.items() if k not in ("bf16",)},
    )
    loaded = create_model_from_path(str(path), **config.model_init_kwargs)
    assert loaded.is_loaded_in_4bit
    assert json.dumps(init)  # plain data, as TrlParser reads it


@pytest.mark.slow
def test_real_qlora_grpo_trial_on_cpu(recipe_factory, tmp_path, monkeypatch):
    """A real TRL GRPO run on a bitsandbytes NF4 base with LoRA, launched as the controller does;
    the random full-precision base it quantizes is the shared cache entry, not a copy per trial."""
    from conftest import params, run_trial

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    result, trial_dir, lines = run_trial(
        recipe_factory, tmp_path, params(2, 1, 2), quantization="4bit", lora_rank=4
    )
    assert result.returncode == 0, result.stderr_tail[-3000:]
    assert not any((trial_dir / "model").glob("*.safetensors"))
    assert len(list((tmp_path / "cache" / "quantized-bases").glob("tiny-qwen-float32-*/*.safetensors"))) >= 1
    stdout = (trial_dir / "stdout.log").read_text()
    assert "base quantized while loading" in stdout and "load_in_4bit=True" in stdout
    assert len(lines) >= 3 and all(line["step_time"] > 0 for line in lines)
    spec = json.loads((trial_dir / "trial_spec.json").read_text())
    assert spec["quantization_config"]["bnb_4bit_quant_type"] == "nf4"


# --- moved from test_review_fixes.py: the quantized shape-only base, built once -----------------------------


def test_quantized_base_is_cached_by_content_and_built_once(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import autotune.worker.model as wm

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    built = []
    real = wm._random_model

    def counting(*a, **k):
        built.append(1)
        time.sleep(0.2)  # the other threads arrive while the first builds
        return real(*a, **k)

    monkeypatch.setattr(wm, "_random_model", counting)
    tiny = resolve_model("tiny-qwen")
    info = {"name": tiny.name, "config": dict(tiny.config), "source": "card"}
    out: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda i=i: out.append(
                wm.write_weights_dir(info, tmp_path / f"trial{i}", "cpu", wm._model_dtype("cpu"))
            )
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 3 and len(set(out)) == 1 and len(built) == 1
    folder = out[0]
    assert folder.is_relative_to(tmp_path / "cache") and (folder / "config.json").is_file()
    assert any(folder.glob("*.safetensors"))
    assert not any((tmp_path / f"trial{i}").exists() for i in range(3))  # nothing per trial
    # another card (or dtype) is another entry
    other = wm.weights_dir_for({**info, "config": {**info["config"], "num_hidden_layers": 1}}, "cpu")
    assert other != folder and wm.weights_dir_for(info, "cuda") != folder


def test_the_speed_prior_counts_the_engine_weights_a_4bit_policy_loads(recipe_factory):
    """Seen on the benchmark (QLoRA 7B on 2 x 40 GB: 16 of 35 runs below 0.95 of the best): the
    speed prior subtracted bf16 weights from a colocated engine's budget, so at fraction 0.2 it
    found no KV cache and ranked the fastest configurations 17x too slow, and no trial went there;
    the memory model meanwhile counted what TRL really starts: for a bitsandbytes 4-bit policy,
    vLLM with ``quantization="bitsandbytes"`` (read here in the installed TRL's own source)."""
    import inspect

    from trl.generation import vllm_generation

    from autotune.candidate.estimate import prior_for
    from autotune.hardware import find_gpu_type

    assert 'quantization = "bitsandbytes"' in inspect.getsource(vllm_generation)
    gpu, model = find_gpu_type("A100-40GB"), resolve_model("Qwen2.5-7B-Instruct")
    params = {**PARAMS, "vllm_tensor_parallel_size": 2}

    def prior(fraction, **kw):
        recipe = recipe_factory(gpus=2, gpu_type=gpu.name, gpu_memory_gib=gpu.memory_gib, lora_rank=16, **kw)
        return prior_for(model, recipe, gpu, {**params, "vllm_gpu_memory_utilization": fraction})

    # 0.2 x 40 GB x 2 GPUs holds the 4-bit weights (about 5 GB) with room for the cache ...
    assert prior(0.2, quantization="4bit") > 0.9 * prior(0.5, quantization="4bit")
    # ... but not bf16 weights (15 GB): there a small fraction is slow, as before
    assert prior(0.2) < 0.5 * prior(0.5)
