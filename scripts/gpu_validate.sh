#!/usr/bin/env bash
# Validate the real GPU path on a machine with an NVIDIA GPU: NVML sampling, real CUDA OOMs,
# real TRL trials on Qwen2.5-1.5B shapes (random weights), export and verify.
#
#   bash scripts/gpu_validate.sh [RUNS_DIR]        (default runs/gpu-validation)
#
# A short lease: TRIALS (default 12), VERIFY_STEPS (6), COMPLETION (1024 tokens) and SEARCH_ARGS
# (extra search flags, e.g. "--time-budget 5m --set gradient_accumulation_steps=1") shrink the run;
# at the defaults one trial of 512 completions per step takes about 6 minutes on an H100.
#
# Needs torch with CUDA, transformers and trl importable (pip install -e ".[trl]"; vllm and
# deepspeed are used when installed, otherwise searched without). Writes RUNS_DIR/report.md with
# trials, the OOM texts seen, peak memory against capacity and NVML utilization; copy it to
# docs/gpu-validation.md.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs/gpu-validation}
mkdir -p "$RUNS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RUNS/nvidia-smi.txt"
python -m autotune doctor | tee "$RUNS/doctor.txt"
python -m autotune estimate --model Qwen2.5-1.5B --gpus 1 --max-prompt-length 512 \
  --max-completion-length "${COMPLETION:-1024}" --set per_device_train_batch_size=32 | tee "$RUNS/estimate.txt"
# 1.5B at 512 + 1024 tokens: micro-batches of 16-32 need more than 80 GB (logits), so the search
# meets real CUDA OOMs on the way to the fastest config that fits.
# shellcheck disable=SC2086  # SEARCH_ARGS is a list of flags
python -m autotune search --model Qwen2.5-1.5B --gpus 1 --runner trl --max-prompt-length 512 \
  --max-completion-length "${COMPLETION:-1024}" --trials "${TRIALS:-12}" --name gpu-1.5b --runs-dir "$RUNS" \
  --warmup-steps 1 --measure-steps 2 --confirm 1 --trial-timeout 15m --hang-timeout 5m ${SEARCH_ARGS:-} \
  2>&1 | tee "$RUNS/search.txt" || true
python -m autotune show gpu-1.5b --runs-dir "$RUNS" | tee "$RUNS/show.txt" || true
python -m autotune verify gpu-1.5b --runs-dir "$RUNS" --steps "${VERIFY_STEPS:-6}" 2>&1 | tee "$RUNS/verify.txt" || true
python scripts/gpu_checks_report.py "$RUNS" >/dev/null
echo "wrote $RUNS/report.md"
