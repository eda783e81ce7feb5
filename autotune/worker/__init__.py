"""The trial process: one short, real TRL GRPO run of one candidate, measured.

``python -m autotune.worker --trial-spec trials/<n>/trial_spec.json`` (or the same module under
``accelerate launch -m`` for several processes). :class:`autotune.runners.trl.TrlRunner` writes the
spec; its format is documented in that module.

What a trial must do to be worth its GPU time:

* **Run what would be exported.** ``GRPOConfig`` is built from the spec's ``grpo_config``, which
  the runner took from :func:`autotune.configs.grpo_config_kwargs`, the same function the
  export uses. The worker only adds what a trial needs and a real run would not: a step limit, a
  log line per step, no checkpoints, no reporting integrations, and EOS suppression (below).
* **Meet the worst case.** Prompts are exactly ``max_prompt_length`` tokens
  (:mod:`autotune.worker.data`; a vision-language model's carry ``images_per_prompt`` synthetic
  images of exactly ``image_tokens`` tokens each on top, :mod:`autotune.worker.vision`) and EOS
  is suppressed until ``max_completion_length`` (``min_new_tokens`` for transformers generation,
  ``min_tokens`` for vLLM's SamplingParams, both through TRL's ``generation_kwargs``), so every
  sequence is as long as the real run's longest.
* **Work without weights.** A model whose weights are not on disk is built from its config with
  random weights ("shape-only"): memory and speed depend on shapes, not values. TRL 1.16 loads the
  reference model (beta > 0) and the colocated vLLM engine *from the policy's path*, which has no
  weights then; see :func:`autotune.worker.model._shape_only_hooks` for how they are built from
  the config instead.
* **Fail loudly.** Nothing is caught: an out-of-memory error or TRL's divisibility ``ValueError``
  reaches stderr as a traceback with a non-zero exit, which is what the controller classifies.

Measurements go to ``$AUTOTUNE_METRICS_FILE`` (docs/trial-contract.md's metrics lines) from
:class:`autotune.worker.callbacks.TrialMetricsCallback`, and TRL's own log dicts are printed to
stdout every step.

Modules, by job (none imports torch, transformers or TRL at import time):

* :mod:`~autotune.worker.trial`: :func:`run_trial`, :func:`load_spec`, :func:`main` (the CLI);
* :mod:`~autotune.worker.config`: the trial's ``GRPOConfig`` and EOS suppression;
* :mod:`~autotune.worker.model`: the policy (checkpoint or shape-only), LoRA, TRL's model hooks;
* :mod:`~autotune.worker.callbacks`: the metrics callback, generation timer, memory figures;
* :mod:`~autotune.worker.data`, :mod:`~autotune.worker.tokenizer`,
  :mod:`~autotune.worker.rewards`: worst-case prompts, the offline tokenizer, the trial's reward;
* :mod:`~autotune.worker.vision`: vision-language trials (the offline processor, synthetic images
  of exactly ``--image-tokens`` tokens, prompts in TRL's VL format);
* :mod:`~autotune.worker.console`: the worker's own lines on stdout.
"""
