"""The benchmark's landscapes: several independent trainer families, each drawn from a seed.

``landscape(index, seed)`` picks a family by the index and draws its hardware, model, batch and
physics from the seed, so that no constant fits every landscape:

- ``trl``: the GRPO simulator (``landscape``) under randomised physics, on tight and roomy hardware,
  with QLoRA (4-bit) and vision-language (768 image tokens) variants; TRL's knob names.
- ``ppo``: a four-model PPO trainer (``ppo``) in its own names, through a template space.
- ``plain``: a trainer whose speed grows with its micro-batch up to an OOM edge, with knobs that do
  nothing, and on some landscapes no memory in its logs (``plain``).

Held out, apart from the report's rotation: ``verl``, a verl-style GRPO trainer (FSDP actor, colocated
vLLM rollout) written after the search had been shaped on the three (``verl``), and ``nemo``, a
NeMo-RL-style one (a Megatron-Core policy split by tensor and pipeline parallelism beside a colocated
vLLM, ``nemo``) written after that. Each held-out family numbers its landscapes in a range of its own
from :data:`HELD_OUT_BASE` (:data:`HELD_OUT_RANGE` wide), so that no run of one shares a name with a
report's run or with the other's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.sim import nemo, plain, ppo, verl
from autotune.sim.family_base import Env
from autotune.sim.physics import Physics

SPACES = Path(__file__).parent / "spaces"
FAMILIES = ("trl", "ppo", "plain")
HELD_OUT = ("verl", "nemo")  # families no search change was measured on before they were written
HELD_OUT_BASE = 1000  # the first index of the first held-out family's landscapes
HELD_OUT_RANGE = 1000  # indices per held-out family: verl 1000-1999, nemo 2000-2999
# the families run through --command and a template space: each module's truth and program
TEMPLATE_FAMILIES = {"ppo": ppo, "plain": plain, "verl": verl, "nemo": nemo}


def held_out_base(family: str) -> int:
    """The first index of a held-out family's landscapes."""
    return HELD_OUT_BASE + HELD_OUT.index(family) * HELD_OUT_RANGE


def held_out_family(index: int) -> str | None:
    """The held-out family whose range holds ``index``, or None (a rotation index, or past them all)."""
    slot = (index - HELD_OUT_BASE) // HELD_OUT_RANGE
    return HELD_OUT[slot] if index >= HELD_OUT_BASE and slot < len(HELD_OUT) else None


# (name, model, gpus, gpu type, global batch, prompt, completion, extra recipe fields)
TRL_CASES: list[tuple[str, str, int, str, int, int, int, dict[str, Any]]] = [
    ("8B on 8 x 24 GB", "Llama-3.1-8B", 8, "A10G", 256, 512, 1024, {}),
    ("14B on 4 x 48 GB", "Qwen2.5-14B", 4, "L40S", 128, 512, 1024, {}),
    (
        "QLoRA 7B on 2 x 40 GB",
        "Qwen2.5-7B-Instruct",
        2,
        "A100-40GB",
        64,
        512,
        1024,
        {"lora_rank": 16, "quantization": "4bit"},
    ),
    (
        "VL 3B, 768 image tokens, 4 x 40 GB",
        "Qwen2.5-VL-3B-Instruct",
        4,
        "A100-40GB",
        128,
        512,
        1024,
        {"image_tokens": 768},
    ),
    ("7B on 4 x 80 GB", "Qwen2.5-7B-Instruct", 4, "H100-80GB", 256, 512, 1024, {}),
    ("1.5B on 2 x 24 GB", "Qwen2.5-1.5B", 2, "RTX-4090", 128, 512, 512, {}),
]

# (name, params in billions, hidden, layers, gpus, GiB per GPU, bf16 TFLOPS, global batch)
PPO_CASES = [
    ("PPO 7B on 8 x 80 GB", 7.6, 3584, 28, 8, 79.3, 312.0, 256),
    ("PPO 3B on 4 x 48 GB", 3.1, 2048, 36, 4, 44.4, 362.0, 128),
    ("PPO 1.5B on 8 x 24 GB", 1.5, 1536, 28, 8, 22.0, 125.0, 256),
]
# (name, params in billions, hidden, layers, kv heads / heads, gpus, GiB per GPU, bf16 TFLOPS,
#  HBM TB/s, GPU-GPU GB/s, gpu type, completions per step)
VERL_CASES = [
    ("verl 7B on 8 x 80 GB", 7.6, 3584, 28, 4 / 28, 8, 79.3, 989.0, 3.35, 450.0, "H100-80GB", 512),
    ("verl 3B on 4 x 24 GB", 3.1, 2048, 36, 2 / 16, 4, 23.6, 165.0, 1.0, 32.0, "RTX-4090", 128),
    ("verl 14B on 8 x 48 GB", 14.8, 5120, 48, 8 / 40, 8, 44.5, 362.0, 0.86, 32.0, "L40S", 256),
    ("verl 1.5B on 4 x 40 GB", 1.5, 1536, 28, 2 / 12, 4, 39.4, 312.0, 1.56, 300.0, "A100-40GB", 256),
]
# (name, model, params in billions, hidden, layers, heads, kv heads, vocab, embeddings (1: tied), gpus,
#  GiB per GPU, bf16 TFLOPS, HBM TB/s, GPU-GPU GB/s, gpu type, completions per step, vLLM's TP)
NEMO_CASES = [
    ("nemo 8B on 8 x 80 GB", "Llama-3.1-8B", 8.0, 4096, 32, 32, 8, 128256, 2, 8, 79.3, 989.0, 3.35, 450.0,
     "H100-80GB", 512, 1),
    ("nemo 3B on 4 x 24 GB", "Qwen2.5-3B", 3.1, 2048, 36, 16, 2, 151936, 1, 4, 23.6, 165.0, 1.0, 32.0,
     "RTX-4090", 128, 1),
    ("nemo 32B on 8 x 80 GB", "Qwen2.5-32B", 32.8, 5120, 64, 40, 8, 152064, 2, 8, 79.3, 312.0, 2.04, 300.0,
     "A100-80GB", 256, 2),
    ("nemo 7B on 8 x 48 GB", "Qwen2.5-7B-Instruct", 7.6, 3584, 28, 28, 4, 152064, 2, 8, 44.5, 362.0, 0.86,
     32.0, "L40S", 256, 2),
]  # fmt: skip
PLAIN_CASES = [
    ("plain 0.5B on 1 x 24 GB", 0.5, 896, 24, 1, 22.0, 165.0, 64),
    ("plain 3B on 2 x 80 GB", 3.1, 2048, 36, 2, 79.3, 989.0, 128),
    ("plain 8B on 8 x 80 GB", 8.0, 4096, 32, 8, 79.3, 312.0, 256),
]


@dataclass(frozen=True)
class LandscapeDef:
    """One benchmark landscape: which trainer, on what, under which physics."""

    index: int
    family: str
    name: str
    physics: Physics
    space: Path | None  # None: autotune's own grpo.yaml
    recipe: dict[str, Any]  # Recipe fields (model, gpus, gpu_type, global_batch, lengths, runner, command)
    env: Env | None = None  # the family's environment (ppo, plain)
    drawn: dict[str, Any] = field(default_factory=dict)  # the landscape's parameters, for the report

    @property
    def truth(self) -> Any:
        module = TEMPLATE_FAMILIES.get(self.family)
        return module.truth if module else None

    @property
    def program(self) -> str:
        module = TEMPLATE_FAMILIES.get(self.family)
        return module.PROGRAM if module else ""


def landscape(index: int, seed: int = 0) -> LandscapeDef:
    """The index-th landscape of the benchmark drawn with ``seed`` (deterministic); from
    :data:`HELD_OUT_BASE` on, a held-out family's (each in its own range; ValueError past them)."""
    rng = random.Random(f"landscape:{seed}:{index}")
    if index >= HELD_OUT_BASE:
        held = held_out_family(index)
        if held is None:
            raise ValueError(f"landscape {index}: past the held-out families' ranges")
        build = _verl if held == "verl" else _nemo
        return build(index, rng, Physics.draw(rng.randrange(2**31)))
    family = FAMILIES[0] if index % 10 < 4 else (FAMILIES[1] if index % 10 < 7 else FAMILIES[2])
    physics = Physics.draw(rng.randrange(2**31))
    if family == "trl":
        return _trl(index, rng, physics)
    return _template(index, family, rng, physics)


def _trl(index: int, rng: random.Random, physics: Physics) -> LandscapeDef:
    name, model, gpus, gpu, batch, prompt, completion, extra = TRL_CASES[_turn(index, 0, 4) % len(TRL_CASES)]
    recipe = dict(
        model=model,
        gpus=gpus,
        gpu_type=gpu,
        global_batch=batch,
        max_prompt_length=prompt,
        max_completion_length=completion,
        runner="sim",
        **extra,
    )
    return LandscapeDef(index, "trl", name, physics, None, recipe, drawn={"case": name, **_brief(physics)})


def _template(index: int, family: str, rng: random.Random, physics: Physics) -> LandscapeDef:
    cases = PPO_CASES if family == "ppo" else PLAIN_CASES
    offset, width = (4, 3) if family == "ppo" else (7, 3)
    name, params_b, hidden, layers, gpus, gib, tflops, batch = cases[_turn(index, offset, width) % len(cases)]
    if family == "ppo":
        extra = {
            "critic_size": rng.uniform(0.3, 1.0),
            "micro_half": rng.uniform(1.0, 6.0),
            "prefix_share": rng.uniform(-0.1, 0.25),
            "kv_ratio": rng.uniform(0.12, 0.25),
        }
        logs = True
    else:
        edge = rng.choice((8, 12, 16, 24))  # the largest micro-batch that fits, before physics
        base = (16.0 * params_b / gpus + 2.0 * params_b) * 1e9 / 2**30 + 0.8
        extra = {"sample_gib": max(gib * 0.93 - base, 1.0) / edge, "micro_half": rng.uniform(2.0, 12.0)}
        logs = rng.random() < 0.5
    shape = (params_b, hidden, layers, gpus, gib, tflops, batch)
    env = _env(shape, physics, extra, prompt=1024, completion=1024, logs=logs)
    module = ppo if family == "ppo" else plain
    gpu_type = {22.0: "A10G", 44.4: "L40S", 79.3: "A100-80GB"}[gib] if family == "ppo" else _gpu_name(gib)
    recipe = _command_recipe(env, _model(params_b), gpu_type, module.TEMPLATE)
    drawn = {
        "case": name,
        "logs_memory": logs,
        **{k: round(v, 3) for k, v in extra.items()},
        **_brief(physics),
    }
    return LandscapeDef(index, family, name, physics, SPACES / module.SPACE, recipe, env, drawn)


def _verl(index: int, rng: random.Random, physics: Physics) -> LandscapeDef:
    case = VERL_CASES[(index - HELD_OUT_BASE) % len(VERL_CASES)]
    name, params_b, hidden, layers, kv_ratio, gpus, gib, tflops, hbm, link, gpu_type, batch = case
    extra = {
        "kv_ratio": kv_ratio,
        "micro_half": rng.uniform(1.0, 8.0),
        "logit_copies": rng.uniform(0.5, 2.5),  # fp32 logits and their log-softmax, or a fused kernel
        "hbm_tbs": hbm,
        "link_gbs": link,
    }
    prompt, completion = rng.choice((512, 1024)), rng.choice((1024, 2048, 4096))
    shape = (params_b, hidden, layers, gpus, gib, tflops, batch)
    env = _env(shape, physics, extra, prompt=prompt, completion=completion, logs=rng.random() < 0.8)
    recipe = _command_recipe(env, _model(params_b), gpu_type, verl.TEMPLATE)
    drawn = _drawn(name, env, extra, physics)
    return LandscapeDef(index, "verl", name, physics, SPACES / verl.SPACE, recipe, env, drawn)


def _nemo(index: int, rng: random.Random, physics: Physics) -> LandscapeDef:
    case = NEMO_CASES[(index - held_out_base("nemo")) % len(NEMO_CASES)]
    name, model, params_b, hidden, layers, heads, kv_heads, vocab, embeddings = case[:9]
    gpus, gib, tflops, hbm, link, gpu_type, batch, vllm_tp = case[9:]
    extra = {
        "heads": heads,
        "kv_ratio": kv_heads / heads,
        "embeddings": embeddings,
        "vllm_tp": vllm_tp,
        "hbm_tbs": hbm,
        "link_gbs": link,
        "micro_half": rng.uniform(1500.0, 8000.0),  # tokens a micro-batch's GEMMs reach half speed at
        "attn_kept": rng.uniform(0.05, 0.4),  # of the attention scores' 5as/h, what a fused kernel keeps
        "logit_copies": rng.uniform(1.0, 2.5),  # fp32 logits and the vocab-parallel softmax's copies
        "fill": rng.uniform(0.4, 0.85),  # a completion's mean share of the longest allowed
        "selective_cost": rng.uniform(0.02, 0.08),  # recomputing core attention, of the update's time
        "cpu_adam": rng.uniform(0.2, 1.0) * 1e9,  # parameters a second one rank's CPU Adam steps
    }
    prompt, completion = rng.choice((512, 1024)), rng.choice((1024, 2048, 4096))
    shape = (params_b, hidden, layers, gpus, gib, tflops, batch)
    env = _env(
        shape, physics, extra, prompt=prompt, completion=completion, logs=rng.random() < 0.8, vocab=vocab
    )
    recipe = _command_recipe(env, model, gpu_type, nemo.template(vllm_tp, prompt + completion))
    drawn = _drawn(name, env, extra, physics)
    return LandscapeDef(index, "nemo", name, physics, SPACES / nemo.SPACE, recipe, env, drawn)


def _drawn(name: str, env: Env, extra: dict[str, float], physics: Physics) -> dict[str, Any]:
    """What a held-out landscape drew, as the benchmark's JSON keeps it."""
    return {
        "case": name,
        "logs_memory": env.logs_memory,
        "prompt": env.prompt,
        "completion": env.completion,
        **{k: round(v, 3) for k, v in extra.items()},
        **_brief(physics),
    }


def _env(
    shape: tuple,
    physics: Physics,
    extra: dict[str, float],
    *,
    prompt: int,
    completion: int,
    logs: bool,
    vocab: int = 151936,
) -> Env:
    """A template family's environment from its case's (params in billions, hidden, layers, gpus, GiB
    per GPU, bf16 TFLOPS, completions per step)."""
    params_b, hidden, layers, gpus, gib, tflops, batch = shape
    return Env(
        gpus=gpus,
        gpu_gib=gib,
        tflops=tflops,
        params_b=params_b,
        hidden=hidden,
        layers=layers,
        vocab=vocab,
        prompt=prompt,
        completion=completion,
        global_batch=batch,
        physics=physics,
        logs_memory=logs,
        extra=extra,
    )


def _command_recipe(env: Env, model: str, gpu_type: str, template: str) -> dict[str, Any]:
    """The recipe of a family run through ``--command`` and its template space."""
    return dict(
        model=model,
        gpus=env.gpus,
        gpu_type=gpu_type,
        global_batch=env.global_batch,
        max_prompt_length=env.prompt,
        max_completion_length=env.completion,
        runner="command",
        command=template,
    )


def _model(params_b: float) -> str:
    if params_b > 10:
        return "Qwen2.5-14B"
    return "Qwen2.5-7B-Instruct" if params_b > 5 else "Qwen2.5-3B" if params_b > 2 else "Qwen2.5-1.5B"


def _turn(index: int, offset: int, width: int) -> int:
    """How many landscapes of this family came before: the cases take turns."""
    return index // 10 * width + index % 10 - offset


def _gpu_name(gib: float) -> str:
    return {22.0: "RTX-4090", 79.3: "H100-80GB"}[gib]


def _brief(physics: Physics) -> dict[str, float]:
    return {k: round(v, 3) for k, v in physics.to_json().items()}


def steady(land: LandscapeDef) -> LandscapeDef:
    """The landscape without transient crashes and run-to-run noise (how long runs are judged)."""
    env = replace(land.env, physics=land.physics.steady()) if land.env else None
    return replace(land, physics=land.physics.steady(), env=env)
