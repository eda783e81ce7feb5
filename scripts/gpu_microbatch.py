"""How a GRPO step's two halves scale with batch on one GPU: what the speed prior assumes, measured.

The speed prior (autotune/candidate/speed.py) once charged training at one model-FLOP utilisation
whatever the micro-batch, and transformers' generate per wave of micro-batches; its launch floors
now come from this script's first run (docs/gpu-validation.md, fourth lease). This measures both on
a model built from a model card with random weights (speed depends on shapes, not values):

* train: forward and backward of ``--global`` sequences of prompt + completion tokens, run as
  micro-batches of each size in ``--batches``, with and without gradient checkpointing: seconds per
  sequence, the FLOP utilisation that implies (6 x params x tokens, 8 with checkpointing), peak
  memory;
* generate: one ``model.generate`` call on each batch in ``--gen-batches`` (prompt tokens in,
  ``--new`` tokens out, sampled, no early stop): seconds per new token, the prefill included (a
  long prompt with few new tokens is mostly prefill).

The loss is taken over every position (``labels``), where TRL keeps only the completion's logits,
so long sequences cost a little more here than in a trainer. Each row is appended to
DIR/microbatch.jsonl as it is measured, so a run stopped by a timeout keeps what it measured.

    python scripts/gpu_microbatch.py [--card qwen2.5-1.5b] [--out DIR]

Writes DIR/microbatch.md and DIR/microbatch.json at the end. On a CPU it runs only tiny cards
(``--card tiny-qwen``), as a smoke test of the script, not a measurement. ``--tflops`` is the
card's dense bf16 figure that MFU is taken against (989: an H100 or H200).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CARDS = Path(__file__).resolve().parent.parent / "autotune" / "cards"


def _model(card: str, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((CARDS / f"{card}.json").read_text())
    raw.pop("_card", None)
    config = AutoConfig.for_model(**raw)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, config


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _train(model, device: str, batch: int, total: int, seq: int, vocab: int, checkpointing: bool) -> dict:
    import torch

    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    ids = torch.randint(0, vocab, (batch, seq), device=device)

    def micro() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    micro()  # warm-up: kernels chosen, allocator grown
    model.zero_grad(set_to_none=True)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = max(total // batch, 1)
    start = time.perf_counter()
    for _ in range(steps):
        micro()
    _sync(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"seconds": seconds, "sequences": steps * batch, "peak_gib": peak}


def _generate(model, device: str, batch: int, prompt: int, new: int, vocab: int) -> dict:
    import torch

    model.eval()
    ids = torch.randint(0, vocab, (batch, prompt), device=device)
    # the KV cache asked for outright: gradient checkpointing, once enabled, turns it off in the config
    kwargs = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0, pad_token_id=0, use_cache=True
    )
    with torch.no_grad():
        model.generate(input_ids=ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        _sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, **kwargs)
        _sync(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "new_tokens": int(out.shape[1] - prompt)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--card", default="qwen2.5-1.5b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--global", dest="total", type=int, default=32)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--gen-batches", default="1,4,16,64")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tflops", type=float, default=989.0, help="the card's dense bf16 TFLOP/s, for MFU")
    ap.add_argument("--out", type=Path, default=Path("runs/microbatch"))
    args = ap.parse_args()

    import torch

    batches = [int(b) for b in args.batches.split(",")]
    if any(b > args.total for b in batches):
        ap.error(
            f"--batches holds a micro-batch over --global {args.total}: each row times --global sequences"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.card.startswith("tiny"):
        ap.error(f"no CUDA device: on a CPU only a tiny card runs (--card tiny-qwen), not {args.card}")
    model, config = _model(args.card, device)
    params = sum(p.numel() for p in model.parameters())
    seq = args.prompt + args.completion
    args.out.mkdir(parents=True, exist_ok=True)
    live = (args.out / "microbatch.jsonl").open("w")
    rows = []

    def keep(r: dict) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)
        live.write(json.dumps(r) + "\n")
        live.flush()

    for batch in (int(b) for b in args.gen_batches.split(",")):
        try:
            r = _generate(model, device, batch, args.prompt, args.new, config.vocab_size)
            r["per_step_s"] = r["seconds"] / max(r["new_tokens"], 1)
        except torch.OutOfMemoryError as exc:
            r = {"error": str(exc).splitlines()[0]}
            torch.cuda.empty_cache()
        keep({**r, "part": "generate", "batch": batch})

    for checkpointing in (False, True) if args.train else ():
        for batch in batches:
            try:
                r = _train(model, device, batch, args.total, seq, config.vocab_size, checkpointing)
            except torch.OutOfMemoryError as exc:
                r = {"error": str(exc).splitlines()[0]}
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            r.update(part="train", batch=batch, checkpointing=checkpointing)
            if "seconds" in r:
                flops = (8 if checkpointing else 6) * params * r["sequences"] * seq
                r["per_sequence_s"] = r["seconds"] / r["sequences"]
                r["mfu"] = flops / r["seconds"] / (args.tflops * 1e12)
            keep(r)
    live.close()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "card": args.card, "params": params, "seq": seq}
    (args.out / "microbatch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"{name}, {args.card} ({params / 1e9:.2f}B), {args.prompt} + {args.completion} tokens", ""]
    lines += ["| micro-batch | checkpointing | s per sequence | MFU | peak GiB |", "|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "train" and "seconds" in r:
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else ""
            gc = "y" if r["checkpointing"] else "n"
            lines.append(f"| {r['batch']} | {gc} | {r['per_sequence_s']:.4f} | {r['mfu']:.2f} | {peak} |")
        elif r["part"] == "train":
            lines.append(f"| {r['batch']} | {'y' if r['checkpointing'] else 'n'} | {r['error']} | | |")
    lines += ["", "| generate batch | s per new token |", "|---|---|"]
    for r in rows:
        if r["part"] == "generate":
            lines.append(
                f"| {r['batch']} | {r['per_step_s']:.4f} |"
                if "per_step_s" in r
                else f"| {r['batch']} | {r['error']} |"
            )
    (args.out / "microbatch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
