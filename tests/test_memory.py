"""The memory model: DeepSpeed's estimator formulas, monotonicity, published figures."""

import pytest
from conftest import COLOCATED, saved_activation_bytes

from autotune.candidate.footprint import zero_model_states_bytes
from autotune.candidate.memory import estimate
from autotune.models import resolve_model
from autotune.units import GIB

QWEN7 = resolve_model("Qwen2.5-7B-Instruct")
BASE = dict(COLOCATED)  # a copy: a test that changed it would change no other module


def est(model=QWEN7, gpus=4, capacity=79.3, prompt=512, completion=1024, **kw):
    return estimate(
        model,
        {**BASE, **kw},
        gpus=gpus,
        capacity_gib=capacity,
        max_prompt_length=prompt,
        max_completion_length=completion,
    )


@pytest.mark.parametrize(
    "stage,offload,expected",
    [
        # DeepSpeed estimate_zero2/3_model_states_mem_needs (0.19), GPU side, P params, LL largest layer, N GPUs
        (2, "none", lambda P, LL, N: 2 * P + 18 * P / N),
        (2, "optimizer", lambda P, LL, N: 2 * P),
        (3, "none", lambda P, LL, N: 4 * LL + 18 * P / N),
        (3, "optimizer", lambda P, LL, N: 4 * LL + 2 * P / N),
        (3, "optimizer+params", lambda P, LL, N: 4 * LL),
        # plain DDP on a bf16 model: torch AdamW keeps m, v in bf16: weights + grads + m + v
        (0, "none", lambda P, LL, N: 8 * P),
        # DeepSpeed bf16 stage 1: bf16 weights + bf16 grads, fp32 master + m + v + grad partition
        (1, "none", lambda P, LL, N: 4 * P + 16 * P / N),
    ],
)
def test_model_states_formulas(stage, offload, expected):
    P, LL = QWEN7.num_params, QWEN7.largest_layer_params
    gpu, _ = zero_model_states_bytes(P, LL, stage, offload, 4)
    assert gpu == pytest.approx(expected(P, LL, 4))


def test_agrees_with_deepspeed_estimators_when_installed():
    z2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    z3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    P, LL = QWEN7.num_params, QWEN7.largest_layer_params
    for offload in (False, True):
        _, gpu = z2.estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=4, cpu_offload=offload)
        assert zero_model_states_bytes(P, LL, 2, "optimizer" if offload else "none", 4)[0] == pytest.approx(
            gpu, rel=1e-6
        )
    for offload, params_too, mode in (
        (False, False, "none"),
        (True, False, "optimizer"),
        (True, True, "optimizer+params"),
    ):
        _, gpu, _ = z3.estimate_zero3_model_states_mem_needs(
            P, LL, num_gpus_per_node=4, cpu_offload=offload, cpu_offload_params=params_too
        )
        assert zero_model_states_bytes(P, LL, 3, mode, 4)[0] == pytest.approx(gpu, rel=1e-6)


@pytest.mark.parametrize(
    "knob,low,high",
    [
        ("per_device_train_batch_size", 2, 8),
        ("vllm_gpu_memory_utilization", 0.3, 0.6),
    ],
)
def test_monotone_up(knob, low, high):
    assert est(**{knob: low}).total_gib < est(**{knob: high}).total_gib


def test_monotone_in_lengths_stage_offload_checkpointing():
    assert est(completion=512).total_gib < est(completion=2048).total_gib
    assert est(prompt=256).total_gib < est(prompt=4096).total_gib
    totals = [est(zero_stage=s, offload="none", use_vllm=False).total_gib for s in (3, 2, 1, 0)]
    # ZeRO-1 on 4 GPUs (4P + 16P/4) costs what plain DDP's bf16 AdamW does (8P)
    assert totals == sorted(totals) and totals[0] < totals[1] < totals[2] == pytest.approx(totals[3])
    offloads = [est(offload=o).total_gib for o in ("optimizer+params", "optimizer", "none")]
    assert offloads == sorted(offloads) and len(set(offloads)) == 3
    assert (
        est(gradient_checkpointing=True).activations_gib < est(gradient_checkpointing=False).activations_gib
    )
    assert est(vllm_enable_sleep_mode=True).vllm_gib < est().vllm_gib


def test_logits_dominate_for_qwen_vocabulary():
    e = est(model=resolve_model("Qwen2.5-0.5B"), gpus=1, per_device_train_batch_size=16, use_vllm=False)
    assert e.logits_gib == max(e.parts.values())


def test_lora_and_reference_model():
    full = est(use_vllm=False, zero_stage=0)
    lora = estimate(
        QWEN7,
        {**BASE, "use_vllm": False, "zero_stage": 0},
        gpus=4,
        capacity_gib=79.3,
        max_prompt_length=512,
        max_completion_length=1024,
        lora_rank=16,
    )
    assert lora.model_states_gib < full.model_states_gib / 3  # ~2P frozen + tiny adapter states vs 8P
    ref = estimate(
        QWEN7,
        {**BASE, "use_vllm": False},
        gpus=4,
        capacity_gib=79.3,
        max_prompt_length=512,
        max_completion_length=1024,
        beta=0.04,
    )
    assert ref.reference_gib == pytest.approx(2 * QWEN7.num_params / 4 / GIB)


def test_vllm_startup_conditions():
    assert est(vllm_gpu_memory_utilization=0.9).vllm_problem == "vllm_startup"  # no room beside the trainer
    small = est(model=QWEN7, vllm_gpu_memory_utilization=0.2, capacity=24.0, completion=8192, prompt=8192)
    assert small.vllm_problem == "vllm_kv"  # weights fill the budget
    assert est().vllm_problem is None


def test_published_figures_as_sanity_ranges():
    # trl#3456: A100-80GB, prompt 2048 / completion 1024, "batch 4": Qwen3-0.6B peaked at 49.3 GiB and
    # Qwen3-1.7B at 78.1 GiB, no vLLM. With 8 generations per prompt that is a micro-batch of 32
    # completions (how TRL < 0.18 counted batches). Our prediction should land within 30%.
    for name, seen in (("Qwen3-0.6B", 49.3), ("Qwen3-1.7B", 78.1)):
        e = estimate(
            resolve_model(name),
            {**BASE, "per_device_train_batch_size": 32, "zero_stage": 0, "use_vllm": False},
            gpus=1,
            capacity_gib=79.3,
            max_prompt_length=2048,
            max_completion_length=1024,
        )
        assert 0.7 * seen < e.total_gib < 1.3 * seen, (name, e.total_gib)
    # verl's minimum-resource table: Qwen2-7B fits on 2 x 80 GB with micro-batch 16, 1024/1024,
    # checkpointing, param+optimizer offload, vLLM TP2 at 0.6 (verl frees the KV cache while training).
    e = estimate(
        QWEN7,
        {
            **BASE,
            "per_device_train_batch_size": 16,
            "offload": "optimizer+params",
            "vllm_tensor_parallel_size": 2,
            "vllm_gpu_memory_utilization": 0.6,
            "vllm_enable_sleep_mode": True,
        },
        gpus=2,
        capacity_gib=79.3,
        max_prompt_length=1024,
        max_completion_length=1024,
    )
    assert e.fits, e
    # the seeds: Qwen2.5-7B on 4 x A100-80GB, ZeRO-3, vLLM 0.6, batch 8, max_length 2048 ran out of memory
    assert not est(
        per_device_train_batch_size=8, vllm_gpu_memory_utilization=0.6, prompt=2048, completion=2048
    ).fits


# Measured on one H100 80GB (docs/gpu-validation.md): real TRL 1.16 GRPO through accelerate +
# DeepSpeed, Qwen2.5-1.5B shapes, use_vllm=false, NVML peak. (name, params, prompt, completion, GiB)
H100 = [
    ("B0 zero0", dict(zero_stage=0, offload="none"), 512, 256, 49.5),
    ("B1 zero1", dict(zero_stage=1, offload="none"), 512, 256, 66.1),
    ("B2 zero2", dict(zero_stage=2, offload="none"), 512, 256, 66.1),
    ("V3 zero3 offload", dict(zero_stage=3, offload="optimizer+params"), 512, 256, 42.0),
    (
        "A zero2 offload ga16",
        dict(
            zero_stage=2,
            offload="optimizer",
            per_device_train_batch_size=32,
            gradient_accumulation_steps=16,
            gradient_checkpointing=True,
        ),
        512,
        1024,
        47.8,
    ),
]
H100_BASE = dict(
    per_device_train_batch_size=16,
    gradient_accumulation_steps=1,
    num_generations=4,
    gradient_checkpointing=False,
    use_vllm=False,
)
H100_CAPACITY = 79.18  # what torch reported in V2's OOM line


def h100(params, prompt=512, completion=256):
    return estimate(
        resolve_model("Qwen2.5-1.5B"),
        {**H100_BASE, **params},
        gpus=1,
        capacity_gib=H100_CAPACITY,
        max_prompt_length=prompt,
        max_completion_length=completion,
    )


@pytest.mark.parametrize("name,params,prompt,completion,measured", H100, ids=[c[0] for c in H100])
def test_h100_measured_peaks(name, params, prompt, completion, measured):
    # today's errors: +4.6% B0, +4.4% B1/B2, +2.4% V3, +5.2% A (all above the measurement: the
    # allocator's reserve is not in NVML's figure or the logits factor is high; a handful of points)
    e = h100(params, prompt, completion)
    assert e.fits
    assert -0.03 <= (e.total_gib - measured) / measured <= 0.07, (name, e.total_gib)


def test_h100_deepspeed_states_over_plain_ddp():
    # ZeRO-1 and ZeRO-2 on one GPU measured 16.6 GiB above plain DDP: fp32 master weights, Adam
    # states and gradient partition that one rank cannot shard away
    plain, z1, z2 = (h100(dict(zero_stage=s, offload="none")) for s in (0, 1, 2))
    assert z1.total_gib == pytest.approx(z2.total_gib)
    assert z1.total_gib - plain.total_gib == pytest.approx(66.1 - 49.5, rel=0.05)


def test_h100_oom_is_predicted():
    # V2: bs=32 at ZeRO 0 died with torch.OutOfMemoryError at 79.6 GiB
    assert not h100(dict(zero_stage=0, offload="none", per_device_train_batch_size=32)).fits


def test_activation_count_matches_autograd_saved_tensors():
    # what autograd really saves in one HF Qwen2 decoder layer (bf16, SDPA): the per-token count
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from autotune.candidate.footprint import layer_activation_bytes_per_token
    from autotune.models import ModelSpec

    h, inter, heads, kv, seq, b = 256, 1024, 4, 2, 64, 2
    cfg = transformers.Qwen2Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=512,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    x = model.model.embed_tokens(torch.randint(0, 512, (b, seq))).detach().requires_grad_()
    rope = model.model.rotary_emb(x, torch.arange(seq)[None])
    layer = model.model.layers[0]
    total = saved_activation_bytes(model, lambda: layer(x, position_embeddings=rope, attention_mask=None))
    measured = (total - sum(c.nbytes for c in rope)) / (b * seq)
    spec = ModelSpec(name="tiny", config=cfg.to_dict(), source="path", path=None, has_weights=False)
    assert layer_activation_bytes_per_token(spec) == pytest.approx(measured, rel=0.1)


def test_generation_without_vllm_counts_the_kv_cache_of_one_generate_call():
    import inspect

    trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    # TRL 1.16: the dataloader hands a device per-device batch x steps_per_generation rows and
    # _generate_single_turn decodes them all in one unwrapped_model.generate() call
    loader = inspect.getsource(trainer.GRPOTrainer.get_train_dataloader)
    assert "self._train_batch_size * self.args.steps_per_generation" in loader
    assert "unwrapped_model.generate(" in inspect.getsource(trainer.GRPOTrainer._generate_single_turn)
    m = resolve_model("Qwen2.5-1.5B")
    e = h100(
        dict(
            zero_stage=2,
            offload="optimizer",
            per_device_train_batch_size=32,
            gradient_accumulation_steps=16,
            gradient_checkpointing=True,
        ),
        completion=1024,
    )
    assert e.generation_sequences == 512
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 * (512 + 1024) * 512 / GIB
    assert kv == pytest.approx(21.0, abs=0.1) and e.generation_gib > kv
    # accumulation raises the peak only without vLLM, and steps_per_generation / generation_batch_size decide it
    low, high = (
        h100(
            dict(gradient_accumulation_steps=g, per_device_train_batch_size=4, gradient_checkpointing=True),
            completion=2048,
        )
        for g in (1, 64)
    )
    assert high.phase == "generation" and high.total_gib > low.total_gib
    assert h100(dict(steps_per_generation=4)).generation_sequences == 64
    assert h100(dict(generation_batch_size=48)).generation_sequences == 48
    assert h100(dict(use_vllm=True, vllm_gpu_memory_utilization=0.3)).generation_sequences == 0


def test_lora_params_by_hand_and_the_vision_tower_adds_its_linears():
    from autotune.candidate.footprint import lora_params

    m = resolve_model("Qwen2.5-7B")
    h, i, q, kv = 3584, 18944, 28 * 128, 4 * 128
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    assert lora_params(m, 16) == 16 * 28 * per_layer
    vl = resolve_model("Qwen2.5-VL-7B")
    assert lora_params(vl, 16) > lora_params(m, 16)


def test_quantized_base_states_and_vllm_weights():
    """A 4-bit base shrinks the states by its weight bytes and the colocated vLLM loads it 4-bit,
    so the KV-cache check that failed for write-up 001 in bf16 passes."""
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_generations=2,
        zero_stage=0,
        offload="none",
        gradient_checkpointing=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
    )
    m = resolve_model("Qwen2.5-7B")
    bf16 = estimate(
        m, base, gpus=2, capacity_gib=39.4, max_prompt_length=500, max_completion_length=2000, lora_rank=16
    )
    nf4 = estimate(
        m,
        base,
        gpus=2,
        capacity_gib=39.4,
        max_prompt_length=500,
        max_completion_length=2000,
        lora_rank=16,
        quantization="4bit",
    )
    assert bf16.vllm_problem == "vllm_kv" and nf4.vllm_problem is None and nf4.fits
    assert 8.5 < bf16.model_states_gib - nf4.model_states_gib < 10
