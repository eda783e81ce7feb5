"""Trial spec -> Scenario: the validated inputs the simulated GRPO trainer's landscape computes on.

A spec holds the trial's parameters (with TRL's defaults where left out), the recipe, a HF
config.json (text part of VL models, MoE experts, vision tower) and the GPU. Parsing checks what
a real trainer would reject as nonsense (``SpecError``); ``trl_config_error`` holds TRL's own
config checks, which a real run reports as a failed trial rather than a bad spec.

Like the rest of the landscape, this reads config.json itself rather than using autotune's model
reader: the truth must not share formulas with what the planner is supposed to learn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.sim.physics import Physics


class SpecError(ValueError):
    """The spec cannot describe a trial (missing model shape, nonsense values)."""


@dataclass(frozen=True)
class Model:
    hidden: int
    inter: int  # dense MLP width, or active experts' total width for MoE
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    params: float  # total parameters, vision tower included
    layer_linear: float  # parameters of one decoder layer's matmuls
    embed: float  # vocab x hidden
    n_tensors: int  # weight tensors (for per-tensor sync costs)
    n_modules: int  # modules with ZeRO-3 hooks
    lora_targets: float  # sum over one layer's linears of (in + out), for LoRA sizing
    vision_hidden: int = 0  # vision tower width (0: a text-only model)
    vision_depth: int = 0

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0

    @property
    def largest_module(self) -> float:
        return max(self.embed, self.layer_linear / 3.0)


def _i(d: dict, key: str, default: Any = None) -> Any:
    v = d.get(key, default)
    return default if v is None else v


def _parse_model(cfg: dict) -> Model:
    """Parameter count and shapes from a HF config.json dict (text part of VL models too)."""
    if not isinstance(cfg, dict):
        raise SpecError("model_config must be a JSON object (a HF config.json)")
    text = cfg
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        text = cfg["text_config"]
    try:
        h = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        vocab = int(text["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise SpecError(
            f"model_config lacks a usable {e} (need hidden_size, num_hidden_layers, "
            "num_attention_heads, vocab_size)"
        ) from None
    if min(h, layers, heads, vocab) <= 0:
        raise SpecError("model_config has non-positive sizes")
    kvh = int(_i(text, "num_key_value_heads", heads))
    hd = int(_i(text, "head_dim", h // heads))
    tied = bool(_i(text, "tie_word_embeddings", _i(cfg, "tie_word_embeddings", False)))
    qd, kvd = heads * hd, kvh * hd
    mtype = str(_i(cfg, "model_type", ""))
    qkv_bias = bool(_i(text, "attention_bias", mtype.startswith("qwen2")))
    attn = h * qd + 2 * h * kvd + qd * h + ((qd + 2 * kvd) if qkv_bias else 0)

    n_experts = int(_i(text, "num_experts", _i(text, "num_local_experts", 0)) or 0)
    if n_experts > 1:
        top_k = int(_i(text, "num_experts_per_tok", 2))
        e_inter = int(_i(text, "moe_intermediate_size", _i(text, "intermediate_size", 4 * h)))
        shared = int(_i(text, "shared_expert_intermediate_size", 0) or 0)
        mlp_total = 3 * h * e_inter * n_experts + 3 * h * shared + h * n_experts
        inter_active = e_inter * top_k + shared
        mlp_active = 3 * h * inter_active
    else:
        inter_active = int(_i(text, "intermediate_size", 4 * h))
        mlp_total = mlp_active = 3 * h * inter_active
    layer_total = attn + mlp_total + 2 * h
    embed = float(vocab * h)
    params = layers * layer_total + embed * (1 if tied else 2) + h

    vh = depth = 0
    vision = cfg.get("vision_config")
    if isinstance(vision, dict) and "hidden_size" in vision:
        vh = int(vision["hidden_size"])
        depth = int(_i(vision, "depth", _i(vision, "num_hidden_layers", 24)))
        vi = int(_i(vision, "intermediate_size", 4 * vh))
        out = int(_i(vision, "out_hidden_size", h))
        params += depth * (4 * vh * vh + 3 * vh * vi) + (4 * vh) ** 2 + 4 * vh * out

    return Model(
        hidden=h,
        inter=inter_active,
        layers=layers,
        heads=heads,
        kv_heads=kvh,
        head_dim=hd,
        vocab=vocab,
        tied=tied,
        params=float(params),
        layer_linear=float(attn + mlp_active),
        embed=embed,
        n_tensors=layers * (12 if qkv_bias else 9) + 3,
        n_modules=layers * 9 + 3,
        lora_targets=float((h + qd) + 2 * (h + kvd) + (qd + h) + 3 * (h + inter_active)),
        vision_hidden=vh,
        vision_depth=depth,
    )


@dataclass(frozen=True)
class Knobs:
    pdbs: int
    ga: int
    num_gen: int
    zero: int
    offload_opt: bool
    offload_params: bool
    gc: bool
    use_vllm: bool
    server: bool
    util: float
    sleep: bool
    tp: int
    vllm_dp: int
    liger: bool
    empty_cache: bool
    spg: int  # steps_per_generation, in micro-steps


@dataclass(frozen=True)
class Gpu:
    name: str
    mem: float  # GiB
    tflops: float
    bw: float  # TB/s
    link: float  # GB/s GPU-GPU


def _as_bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.lower() in ("true", "1", "yes")
    raise SpecError(f"{name} must be a boolean, got {v!r}")


def _as_int(v: Any, name: str, low: int = 1) -> int:
    try:
        iv = int(v)
    except (TypeError, ValueError):
        raise SpecError(f"{name} must be an integer, got {v!r}") from None
    if iv != v and not (isinstance(v, str) and v.strip().lstrip("-").isdigit()):
        raise SpecError(f"{name} must be an integer, got {v!r}")
    if iv < low:
        raise SpecError(f"{name} must be >= {low}, got {iv}")
    return iv


def _parse_knobs(p: dict) -> Knobs:
    """Parameters with TRL's defaults where the spec leaves them out."""
    if not isinstance(p, dict):
        raise SpecError("params must be a JSON object")
    pdbs = _as_int(_i(p, "per_device_train_batch_size", 8), "per_device_train_batch_size")
    ga = _as_int(_i(p, "gradient_accumulation_steps", 1), "gradient_accumulation_steps")
    num_gen = _as_int(_i(p, "num_generations", 8), "num_generations", low=0)
    zero = _as_int(_i(p, "zero_stage", 0), "zero_stage", low=0)
    if zero > 3:
        raise SpecError(f"zero_stage must be 0-3, got {zero}")
    offload = str(_i(p, "offload", "none")).lower()
    if offload not in ("none", "optimizer", "optimizer+params"):
        raise SpecError(f"offload must be none|optimizer|optimizer+params, got {offload!r}")
    mode = str(_i(p, "vllm_mode", "colocate")).lower()
    if mode not in ("colocate", "server"):
        raise SpecError(f"vllm_mode must be colocate|server, got {mode!r}")
    try:
        util = float(_i(p, "vllm_gpu_memory_utilization", 0.3))
    except (TypeError, ValueError):
        raise SpecError("vllm_gpu_memory_utilization must be a number") from None
    if not 0.0 < util <= 1.0:
        raise SpecError(f"vllm_gpu_memory_utilization must be in (0, 1], got {util}")
    use_vllm = _as_bool(_i(p, "use_vllm", False), "use_vllm")
    server = use_vllm and mode == "server"
    if server:
        # `trl vllm-serve` has its own --gpu_memory_utilization (default 0.9); the trainer's
        # colocate fraction does not apply to it.
        util = float(_i(p, "vllm_server_gpu_memory_utilization", 0.9))
    spg_raw = p.get("steps_per_generation")
    spg = ga if spg_raw is None else _as_int(spg_raw, "steps_per_generation")
    tce = p.get("torch_empty_cache_steps")
    return Knobs(
        pdbs=pdbs,
        ga=ga,
        num_gen=num_gen,
        zero=zero,
        # DeepSpeed only offloads from ZeRO >= 1 (optimizer) and ZeRO 3 (params); below that the
        # extra offload keys are ignored, which is what this models.
        offload_opt=offload != "none" and zero >= 1,
        offload_params=offload == "optimizer+params" and zero == 3,
        gc=_as_bool(_i(p, "gradient_checkpointing", True), "gradient_checkpointing"),
        use_vllm=use_vllm,
        server=server,
        util=util,
        sleep=use_vllm
        and not server
        and _as_bool(_i(p, "vllm_enable_sleep_mode", False), "vllm_enable_sleep_mode"),
        tp=_as_int(_i(p, "vllm_tensor_parallel_size", 1), "vllm_tensor_parallel_size"),
        vllm_dp=_as_int(_i(p, "vllm_data_parallel_size", 1), "vllm_data_parallel_size"),
        liger=_as_bool(_i(p, "use_liger_kernel", False), "use_liger_kernel"),
        empty_cache=bool(tce) and int(tce) > 0,
        spg=spg,
    )


def _parse_gpu(g: Any) -> Gpu:
    if not isinstance(g, dict):
        raise SpecError("gpu must be a JSON object with memory_gib")
    try:
        mem = float(g["memory_gib"])
    except (KeyError, TypeError, ValueError):
        raise SpecError("gpu.memory_gib is required (GiB per GPU)") from None
    if mem <= 0.5:
        raise SpecError(f"gpu.memory_gib must be positive, got {mem}")
    try:
        return Gpu(
            name=str(g.get("name", "GPU")),
            mem=mem,
            tflops=float(_i(g, "tflops_bf16", 312.0)),
            bw=float(_i(g, "bandwidth_tbs", 2.0)),
            link=float(_i(g, "interconnect_gbs", 300.0)),
        )
    except (TypeError, ValueError):
        raise SpecError("gpu fields must be numbers") from None


@dataclass(frozen=True)
class Scenario:
    m: Model
    k: Knobs
    gpu: Gpu
    gpus: int
    prompt: int
    completion: int
    beta: float
    lora_rank: int | None
    host_gib: float
    max_model_len: int
    max_steps: int
    seed: int
    physics: Physics = field(default_factory=Physics)
    quant_bits: int = 16  # how the frozen base is stored (4: QLoRA's NF4)
    image_tokens: int = 0  # prompt tokens that come from images, per prompt


def parse_spec(spec: dict) -> Scenario:
    """Validate a spec into the scenario the landscape computes on; raises SpecError."""
    if not isinstance(spec, dict):
        raise SpecError("spec must be a JSON object")
    recipe = spec.get("recipe") or {}
    if not isinstance(recipe, dict):
        raise SpecError("recipe must be a JSON object")
    if "model_config" not in spec:
        raise SpecError("spec lacks model_config")
    m = _parse_model(spec["model_config"])
    k = _parse_knobs(spec.get("params") or {})
    gpu = _parse_gpu(spec.get("gpu"))
    gpus = _as_int(_i(recipe, "gpus", 1), "recipe.gpus")
    prompt = _as_int(_i(recipe, "max_prompt_length", 512), "recipe.max_prompt_length")
    completion = _as_int(_i(recipe, "max_completion_length", 512), "recipe.max_completion_length")
    lora = recipe.get("lora_rank")
    lora_rank = _as_int(lora, "recipe.lora_rank") if lora not in (None, 0) else None
    prompt += _as_int(_i(recipe, "image_tokens", 0), "recipe.image_tokens", low=0)  # images join the prompt
    mml = _i(recipe, "vllm_max_model_length", _i(spec.get("params") or {}, "vllm_max_model_length", 0))
    try:
        beta = float(_i(recipe, "beta", 0.0))
        host = float(_i(recipe, "host_memory_gib", 512.0))
        seed = int(_i(spec, "seed", 0))
    except (TypeError, ValueError):
        raise SpecError("recipe.beta, recipe.host_memory_gib and seed must be numbers") from None
    return Scenario(
        m=m,
        k=k,
        gpu=gpu,
        gpus=gpus,
        prompt=prompt,
        completion=completion,
        beta=beta,
        lora_rank=lora_rank,
        host_gib=host,
        max_model_len=int(mml) if mml else prompt + completion,
        max_steps=_as_int(_i(spec, "max_steps", 20), "max_steps"),
        seed=seed,
        physics=Physics.from_json(spec.get("physics")),
        quant_bits={"4bit": 4, "8bit": 8}.get(str(recipe.get("quantization")), 16),
        image_tokens=_as_int(_i(recipe, "image_tokens", 0), "recipe.image_tokens", low=0),
    )


def trl_config_error(sc: Scenario, n_train: int) -> str | None:
    """TRL's own config checks (GRPOConfig / GRPOTrainer), in the order TRL runs them."""
    k = sc.k
    if k.server and n_train < 1:
        return "server_no_train_gpus"
    if k.num_gen < 2:
        return "num_generations_lt2"
    gen_batch = k.pdbs * n_train * k.spg
    if gen_batch % k.num_gen:
        return "gen_batch_div_num_gen"
    if gen_batch % (k.pdbs * n_train):
        return "gen_batch_div_global"
    if k.use_vllm and not k.server and sc.gpus % k.tp:
        return "tp_divides_world"
    return None
