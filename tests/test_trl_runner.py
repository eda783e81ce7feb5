"""The TRL runner's fast parts: checks, rules, launch files and argv, sidecar helpers, tokenizer, data.

The real trials (TRL on CPU, OOMs, two processes) are in test_worker.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from autotune import configs as lc
from autotune.candidate.space_file import load_space
from autotune.errors import UsageError
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.runners import trl as trl_runner
from autotune.runners.base import EXTRA_STEPS, TrialContext, free_port
from autotune.runners.trl import TrlRunner, start_sidecar, stop_sidecar, wait_health
from autotune.trial.launch import LaunchSpec

PLAIN = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    num_generations=2,
    gradient_checkpointing=True,
    use_vllm=False,
    zero_stage=0,
    offload="none",
)


@pytest.fixture
def runner(recipe_factory, monkeypatch):
    """A TrlRunner on tiny-qwen; pass recipe fields to override."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def make(**kw):
        base = dict(
            model="tiny-qwen",
            gpus=1,
            runner="trl",
            device="cpu",
            max_prompt_length=32,
            max_completion_length=16,
            warmup_steps=1,
            measure_steps=2,
        )
        base.update(kw)
        recipe = recipe_factory(**base)
        context = TrialContext(
            recipe=recipe,
            space=load_space(),
            model=resolve_model(recipe.model),
            gpu=find_gpu_type(recipe.gpu_type),
        )
        return TrlRunner(context)

    return make


def reasons(runner, params):
    return [r for rule in runner.rules() if (r := rule(params))]


# -- check ----------------------------------------------------------------------------------------


def test_check_passes_on_cpu_with_packages(runner):
    runner(device="cpu").check()


def test_check_names_missing_packages_in_one_line(runner, monkeypatch):
    monkeypatch.setattr(trl_runner, "installed", lambda name: name not in ("trl", "peft"))
    with pytest.raises(UsageError) as err:
        runner(lora_rank=8).check()
    message = str(err.value)
    assert "trl, peft" in message and "pip install -e '.[trl]'" in message and "\n" not in message


def test_check_cuda_without_gpu_suggests_cpu_or_sim(runner):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(UsageError, match=r"--device cpu.*--runner sim"):
        runner(device="cuda").check()


def test_check_memory_limit_is_for_cpu(runner):
    with pytest.raises(UsageError, match="--device cpu"):
        runner(device="cuda", memory_limit_gib=8).check()


def test_check_missing_dataset_file(runner, tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        runner(dataset=str(tmp_path / "nope.jsonl")).check()


def test_check_quantization_needs_lora_and_bitsandbytes(runner, monkeypatch):
    with pytest.raises(UsageError, match="add --lora-rank") as err:
        runner(quantization="4bit").check()
    assert "\n" not in str(err.value)
    monkeypatch.setattr(trl_runner, "installed", lambda name: name != "bitsandbytes")
    with pytest.raises(UsageError, match="pip install bitsandbytes"):
        runner(quantization="4bit", lora_rank=4).check()


def test_check_gptq_checkpoint_without_weights_is_refused(runner, tmp_path):
    config = dict(
        resolve_model("tiny-qwen").config,
        quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128},
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="GPTQ int4.*pass the checkpoint's directory"):
        runner(model=str(tmp_path), lora_rank=4).check()


def test_quantized_trial_spec_carries_the_bitsandbytes_config(runner, tmp_path):
    spec = json.loads(
        (
            runner(quantization="4bit", lora_rank=4).prepare(PLAIN, tmp_path / "t", 0).trial_dir
            / trl_runner.SPEC_FILE
        ).read_text()
    )
    assert spec["quantization_config"] == {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "float32",  # the CPU trial's dtype
        "bnb_4bit_quant_storage": "float32",
    }
    plain = json.loads(
        (runner().prepare(PLAIN, tmp_path / "p", 0).trial_dir / trl_runner.SPEC_FILE).read_text()
    )
    assert plain["quantization_config"] is None


def test_rule_8bit_with_colocated_vllm_is_invalid_like_trl(runner, monkeypatch):
    monkeypatch.setattr(trl_runner, "installed", lambda name: True)
    gpu = runner(device="cuda", gpus=2, quantization="8bit", lora_rank=4)
    (why,) = reasons(gpu, {**PLAIN, "use_vllm": True, "vllm_mode": "colocate"})
    assert "vLLM does not support in-flight 8-bit quantization" in why
    assert reasons(gpu, {**PLAIN, "use_vllm": True, "vllm_mode": "server"}) == []
    assert (
        reasons(
            runner(device="cuda", gpus=2, quantization="4bit", lora_rank=4),
            {**PLAIN, "use_vllm": True, "vllm_mode": "colocate"},
        )
        == []
    )


# -- rules ----------------------------------------------------------------------------------------


def test_rules_missing_vllm_and_deepspeed_make_candidates_invalid(runner, monkeypatch):
    monkeypatch.setattr(trl_runner, "installed", lambda name: name not in ("vllm", "deepspeed"))
    gpu = runner(device="cuda", gpus=2)
    assert reasons(gpu, PLAIN) == []
    assert reasons(gpu, {**PLAIN, "use_vllm": True, "vllm_mode": "colocate"}) == [
        "use_vllm needs the vllm package (pip install -e '.[vllm]')"
    ]
    (why,) = reasons(gpu, {**PLAIN, "zero_stage": 3})
    assert "deepspeed package" in why and "pip install -e '.[deepspeed]'" in why
    (why,) = reasons(gpu, {**PLAIN, "zero_stage": 0, "offload": "optimizer"})
    assert "offload=optimizer" in why


def test_rules_pass_when_packages_are_there(runner, monkeypatch):
    monkeypatch.setattr(trl_runner, "installed", lambda name: True)
    gpu = runner(device="cuda", gpus=2)
    assert reasons(gpu, {**PLAIN, "use_vllm": True, "zero_stage": 3, "offload": "optimizer+params"}) == []


def test_rules_on_cpu(runner, monkeypatch):
    monkeypatch.setattr(trl_runner, "installed", lambda name: True)  # even with the packages
    cpu = runner(device="cpu")
    assert reasons(cpu, PLAIN) == []
    (why,) = reasons(cpu, {**PLAIN, "use_vllm": True})
    assert "vLLM needs a GPU" in why
    # DeepSpeed ZeRO and offload run on CPU too (gloo, CPU Adam): tests/test_deepspeed_cpu.py
    assert reasons(cpu, {**PLAIN, "zero_stage": 3, "offload": "optimizer+params"}) == []
    assert cpu.forced() == {"use_vllm": False}
    monkeypatch.setattr(trl_runner, "installed", lambda name: name != "deepspeed")
    (why,) = reasons(cpu, {**PLAIN, "zero_stage": 2})
    assert "deepspeed package" in why and "DS_BUILD_OPS=0 pip install" in why
    assert cpu.forced() == {"use_vllm": False, "zero_stage": 0, "offload": "none"}


# -- prepare --------------------------------------------------------------------------------------


def test_prepare_single_process(runner, tmp_path):
    run = runner(memory_limit_gib=3.0, beta=0.04)
    spec = run.prepare(PLAIN, tmp_path / "t0", 0)
    path = tmp_path / "t0" / "trial_spec.json"
    assert spec.argv == [sys.executable, "-m", "autotune.worker", "--trial-spec", str(path.resolve())]
    assert spec.memory_limit_gib == 3.0 and spec.sidecars == []
    assert spec.env["AUTOTUNE_METRICS_FILE"].endswith("metrics.jsonl")
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "" and int(spec.env["OMP_NUM_THREADS"]) >= 1
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["params"] == PLAIN
    assert data["grpo_config"] == lc.grpo_config_kwargs(PLAIN, run.recipe)  # what export writes
    assert data["grpo_config"]["beta"] == 0.04 and data["grpo_config"]["use_cpu"] is True
    assert data["max_steps"] == 1 + 2 + EXTRA_STEPS
    assert data["model"]["name"] == "tiny-qwen" and data["model"]["has_weights"] is False
    assert data["model"]["config"]["vocab_size"] == 151936
    assert data["processes"] == 1 and data["device"] == "cpu"
    assert not (tmp_path / "t0" / "accelerate_config.yaml").exists()


def test_prepare_two_cpu_processes_uses_accelerate_with_torchrun(runner, tmp_path):
    run = runner(gpus=2)
    spec = run.prepare(PLAIN, tmp_path / "t1", 1)
    trial = tmp_path / "t1"
    argv = spec.argv
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert argv[argv.index("--config_file") + 1] == str(trial / "accelerate_config.yaml")
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert int(argv[argv.index("--main_process_port") + 1]) > 0
    assert "--multi_gpu" in argv  # MULTI_CPU alone would start one process (mpirun launcher)
    assert argv[-4:] == ["-m", "autotune.worker", "--trial-spec", str((trial / "trial_spec.json").resolve())]
    config = yaml.safe_load((trial / "accelerate_config.yaml").read_text())
    assert config == lc.accelerate_config(PLAIN, run.recipe, None)
    assert config["use_cpu"] is True and config["num_processes"] == 2
    assert int(spec.env["OMP_NUM_THREADS"]) >= 1


def test_prepare_deepspeed_on_gpu_writes_ds_config(runner, tmp_path):
    params = {**PLAIN, "zero_stage": 3, "offload": "optimizer"}
    run = runner(device="cuda", gpus=1)  # ZeRO-offload on one GPU still needs the launcher
    spec = run.prepare(params, tmp_path / "t2", 2)
    trial = tmp_path / "t2"
    ds = json.loads((trial / "ds_config.json").read_text())
    assert ds == lc.deepspeed_config(params, run.recipe)
    config = yaml.safe_load((trial / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "DEEPSPEED"
    assert config["deepspeed_config"]["deepspeed_config_file"] == str((trial / "ds_config.json").resolve())
    assert "accelerate.commands.launch" in spec.argv and "--multi_gpu" not in spec.argv
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0"


def test_prepare_vllm_server_mode_adds_sidecar_on_its_own_gpus(runner, tmp_path):
    params = {**PLAIN, "use_vllm": True, "vllm_mode": "server", "vllm_tensor_parallel_size": 1}
    run = runner(device="cuda", gpus=4)
    spec = run.prepare(params, tmp_path / "t3", 3)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    (side,) = spec.sidecars
    assert side.env["CUDA_VISIBLE_DEVICES"] == "3"
    shape_dir = (tmp_path / "t3" / "model").resolve()
    tokenizer_dir = (tmp_path / "t3" / "tokenizer").resolve()
    served = lc.vllm_serve_command(params, run.recipe, str(shape_dir), port=side.port)
    assert side.argv == [
        sys.executable,
        "-m",
        "trl.cli.main",
        *served[1:],
        "--load-format",
        "dummy",
        "--tokenizer",
        str(tokenizer_dir),
    ]
    assert "vllm-serve" in side.argv
    assert (shape_dir / "config.json").is_file() and (tokenizer_dir / "tokenizer.json").is_file()
    assert json.loads((shape_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # what vLLM will do with the folder: AutoTokenizer, offline, the full vocabulary
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)) == 151936
    assert spec.argv[spec.argv.index("--num_processes") + 1] == "3"


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- sidecar helpers ------------------------------------------------------------------------------


class _Health(BaseHTTPRequestHandler):
    ready_at = 0.0

    def do_GET(self):  # noqa: N802 (http.server's name)
        ok = self.path == "/health/" and time.monotonic() >= self.ready_at
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_health_polls_until_ready():
    _Health.ready_at = time.monotonic() + 0.5
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        took = wait_health(f"http://127.0.0.1:{server.server_port}/health/", timeout_s=10, interval_s=0.1)
        assert 0.4 <= took < 10
    finally:
        server.shutdown()


def test_wait_health_reports_a_dead_server_and_a_timeout(tmp_path):
    side = LaunchSpec(
        argv=[sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
        env={},
        trial_dir=tmp_path / "side",
    )
    proc = start_sidecar(side)
    with pytest.raises(RuntimeError, match="status 3"):
        wait_health(f"http://127.0.0.1:{free_port()}/health/", timeout_s=30, proc=proc, interval_s=0.1)
    assert "boom" in (tmp_path / "side" / "stderr.log").read_text()
    with pytest.raises(TimeoutError):
        wait_health(f"http://127.0.0.1:{free_port()}/health/", timeout_s=0.3, interval_s=0.1)


def test_stop_sidecar_ends_its_group(tmp_path):
    side = LaunchSpec(
        argv=[sys.executable, "-c", "import time; time.sleep(600)"], env={}, trial_dir=tmp_path / "side"
    )
    proc = start_sidecar(side)
    stop_sidecar(proc, grace_s=2)
    assert proc.returncode is not None


# -- tokenizer ------------------------------------------------------------------------------------


def test_synthetic_tokenizer_covers_the_full_vocab_fast():
    import transformers  # noqa: F401  (import time is not what is measured)

    from autotune.worker.tokenizer import synthetic_tokenizer

    config = resolve_model("tiny-qwen").config
    start = time.perf_counter()
    tok = synthetic_tokenizer(config)
    took = time.perf_counter() - start
    assert took < 2.0, took
    assert len(tok) == 151936
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151645 and tok.bos_token_id == 151643
    assert tok("t0 t17 t151935")["input_ids"] == [0, 17, 151935]
    assert tok.decode([1, 2, 151935]) == "t1 t2 t151935"
    assert tok("some words")["input_ids"] == [0, 0]  # unknown words: one ordinary token each


def test_load_tokenizer_prefers_the_models_own(tmp_path):
    from autotune.worker.tokenizer import has_tokenizer_files, load_tokenizer

    own = _bpe_tokenizer(tmp_path / "tok")
    assert has_tokenizer_files(tmp_path / "tok") and not has_tokenizer_files(tmp_path)
    loaded = load_tokenizer({"vocab_size": 151936}, tmp_path / "tok")
    assert len(loaded) == len(own) and loaded.pad_token is not None
    assert len(load_tokenizer({"vocab_size": 1000}, tmp_path)) == 1000


# -- data -----------------------------------------------------------------------------------------


def _bpe_tokenizer(dest):
    """A small real BPE tokenizer trained in-process and saved like a model's own (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    text = [
        "the quick brown fox jumps over the lazy dog " * 3,
        "hello world, tokens and more tokens",
        "x a the 0 . ! hello " * 5,
    ]
    core.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<unk>", "<eos>", "<s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", unk_token="<unk>", bos_token="<s>"
    )
    tok.save_pretrained(str(dest))
    return tok


def test_worst_case_prompts_are_exactly_the_prompt_length():
    from autotune.worker.data import prompt_length, worst_case_prompts
    from autotune.worker.tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(resolve_model("tiny-qwen").config)
    prompts = worst_case_prompts(tok, 32, 5, seed=1)
    assert len(prompts) == 5 and len(set(prompts)) == 5
    assert all(prompt_length(tok, p) == 32 for p in prompts)
    ids = tok(prompts[0])["input_ids"]
    assert not set(ids) & {tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}


def test_user_dataset_is_cut_or_padded_to_the_exact_length(tmp_path):
    from autotune.worker.data import build_dataset, prompt_length
    from autotune.worker.tokenizer import synthetic_tokenizer

    rows = [
        {"prompt": "short one"},
        {"prompt": " ".join(f"w{i}" for i in range(100))},
        {"prompt": [{"role": "user", "content": "a chat prompt"}]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = synthetic_tokenizer(resolve_model("tiny-qwen").config)
    dataset = build_dataset(tok, 24, 7, dataset=path)
    assert len(dataset) == 7  # cycled to fill the generation batches
    assert all(prompt_length(tok, p) == 24 for p in dataset["prompt"])
    assert dataset["prompt"][0].startswith("short one short")


def test_real_tokenizer_prompts_are_exact_too(tmp_path):
    from autotune.worker.data import build_dataset, fit_prompt, prompt_length
    from autotune.worker.tokenizer import load_tokenizer

    _bpe_tokenizer(tmp_path / "tok")
    tok = load_tokenizer({"vocab_size": 300}, tmp_path / "tok")
    for text in (
        "",
        "hello world",
        "the quick brown fox jumps over the lazy dog " * 10,
        "tokens!!! and more",
    ):
        for length in (1, 7, 32):
            assert prompt_length(tok, fit_prompt(tok, text, length)) == length, (text, length)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello world"}\n{"prompt": "the lazy dog jumps"}\n')
    assert all(prompt_length(tok, p) == 16 for p in build_dataset(tok, 16, 4, dataset=path)["prompt"])
    assert all(prompt_length(tok, p) == 16 for p in build_dataset(tok, 16, 3)["prompt"])


def test_bad_dataset_lines_are_usage_errors(tmp_path):
    from autotune.worker.data import read_prompts

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: .*'prompt'"):
        read_prompts(path)
    path.write_text("not json\n")
    with pytest.raises(UsageError, match="not a JSON line"):
        read_prompts(path)


def test_prompts_needed_covers_every_step():
    from autotune.worker.data import prompts_needed

    # 16 completions per step, 4 per prompt: 4 prompts a step, for 5 steps plus one
    assert prompts_needed(16, 4, 5) == 24
    assert prompts_needed(6, 4, 1) == 4  # a partial group still needs its prompt


# -- reward and worker pieces ---------------------------------------------------------------------


def test_reward_is_cheap_varied_and_picklable():
    import pickle

    from autotune.worker.rewards import length_noise_reward

    values = length_noise_reward(["abc"] * 8)
    assert len(values) == 8 and len(set(values)) == 8
    assert pickle.loads(pickle.dumps(length_noise_reward)) is length_noise_reward


def test_eos_suppression_uses_each_backends_name():
    from autotune.worker.config import suppress_eos_kwargs

    assert suppress_eos_kwargs(64, use_vllm=False) == {"min_new_tokens": 64}
    assert suppress_eos_kwargs(64, use_vllm=True) == {"min_tokens": 64}


def test_grpo_config_is_the_exported_one_plus_trial_fields(runner, tmp_path):
    from autotune.worker.config import build_grpo_config

    run = runner()
    run.prepare(PLAIN, tmp_path / "t", 0)
    spec = json.loads((tmp_path / "t" / "trial_spec.json").read_text())
    args = build_grpo_config(spec)
    for key, value in spec["grpo_config"].items():
        assert getattr(args, key) == value, key
    assert args.max_steps == spec["max_steps"] and args.logging_steps == 1 and args.use_cpu
    assert args.generation_kwargs == {"min_new_tokens": 16} and args.report_to == []


def test_worker_rejects_a_foreign_spec(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"version": 99}')
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.worker", "--trial-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "version-1 trial spec" in proc.stderr


def test_shape_only_hooks_redirect_only_the_shape_dir(monkeypatch, tmp_path):
    """TRL's reference-model loader and vLLM engine are pointed at random weights, nothing else."""
    import trl.generation.vllm_generation as vllm_generation
    import trl.trainer.grpo_trainer as grpo_trainer

    from autotune.worker.model import _shape_only_hooks, write_shape_dir

    calls = []
    monkeypatch.setattr(
        grpo_trainer, "create_model_from_path", lambda *a, **k: calls.append((a, k)) or "loaded"
    )
    monkeypatch.setattr(vllm_generation, "LLM", lambda **kw: kw, raising=False)
    info = {"name": "tiny-qwen", "source": "card", "config": resolve_model("tiny-qwen").config}
    model_dir = write_shape_dir(info, tmp_path, "cpu")
    _shape_only_hooks(model_dir, None, tmp_path / "tokenizer")

    assert grpo_trainer.create_model_from_path("some/real-model", dtype="bfloat16") == "loaded"
    assert calls == [(("some/real-model", None), {"dtype": "bfloat16"})]
    import torch

    ref = grpo_trainer.create_model_from_path(str(model_dir), dtype=torch.float32)
    assert ref.config.vocab_size == 151936 and ref.dtype == torch.float32 and len(calls) == 1
    assert sum(p.numel() for p in ref.parameters()) == resolve_model("tiny-qwen").num_params
    engine = vllm_generation.LLM(model=str(model_dir), gpu_memory_utilization=0.3)
    assert engine == {
        "model": str(model_dir),
        "gpu_memory_utilization": 0.3,
        "load_format": "dummy",
        "tokenizer": str(tmp_path / "tokenizer"),
    }
