"""Generation time of one engine (vLLM or transformers' ``generate``) in the simulated landscape."""

from __future__ import annotations

from autotune.sim.scenario import Gpu, Knobs, Model, Scenario


def generation_time(sc: Scenario, m: Model, k: Knobs, g: Gpu, seqs: int, conc: int, P: float) -> float:
    """Seconds for one engine to produce `seqs` completions of full length.

    Decode is bound by reading the weights (and KV) from HBM at small batch, by FLOPs at large
    batch; the KV cache caps how many sequences run at once, so a small vLLM fraction means
    several waves. Without vLLM, transformers' generate pays Python overhead per token.
    """
    C, prompt = sc.completion, sc.prompt
    bw = g.bw * 1e12 * 0.78
    tfl = g.tflops * 1e12
    active = 2.0 * (m.layers * m.layer_linear + m.embed)
    if not k.use_vllm:
        # transformers generate: all of the generation batch at once, ZeRO-3 gathered weights
        per_tok = (
            0.021
            + 2.0 * P / (bw * 0.75)
            + active * seqs / (tfl * 0.3)
            + seqs * (prompt + C / 2) * m.kv_bytes_per_token / bw
        )
        prefill = active * seqs * prompt / (tfl * 0.35)
        return prefill + C * per_tok + 0.3
    tp = k.tp
    kvb = m.kv_bytes_per_token / min(tp, m.kv_heads)
    c = max(conc, 1)
    waves = []
    left = seqs
    while left > 0:
        waves.append(min(c, left))
        left -= c
    total = 0.0
    for nw in waves:
        w_read = 2.0 * P / tp / bw
        kv_read = nw * (prompt + C / 2) * kvb / bw
        compute = active * nw / tp / (tfl * 0.45)
        comm = 2 * m.layers * (18e-6 + nw * m.hidden * 2.0 / (g.link * 1e9 * 0.6)) if tp > 1 else 0.0
        step = 0.0035 + max(w_read + kv_read, compute) + comm + nw * 0.5e-6
        uniq = max(1.0, nw / max(k.num_gen, 1))  # prefix caching shares each prompt
        prefill = active * uniq * prompt / tp / (tfl * 0.55) + 0.02
        total += prefill + C * step
    if len(waves) > 1:
        total *= 1.06  # preemption and recompute when the KV cache runs full
    return total + 0.15
