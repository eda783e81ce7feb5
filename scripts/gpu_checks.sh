#!/usr/bin/env bash
# The GPU checks a CPU cannot make: each part runs autotune itself, end to end, through its real TRL
# path, on one H100. The default four take about 12 minutes there (run 7, the others 1.5 to 3 each), more
# than one 10-minute call with its start: on a short lease run PARTS="run vl", then the other two.
#
#   bash scripts/gpu_checks.sh [RUNS_DIR] [DEADLINE_S]     (defaults: runs/gpu-checks, 480)
#
#   run       a production run (`autotune run`) that dies of a real CUDA OOM after a checkpoint and
#             is resumed from it on the smaller batch the study measured (Qwen2.5-1.5B shape);
#   zero3     a Qwen2.5-7B shape under ZeRO-3 with optimizer+params offload (LoRA: a full 7B's
#             fp32 optimizer states on the host need ~120 GiB, more than the machine's 128 GiB);
#   zero3probe  the zero3 trial with 2 measured steps (three generations) under the tensor probe
#             (scripts/gpu_probe/sitecustomize.py): at the first three generations' entry, gather
#             and exit and at the end of steps 1-3, the live CUDA tensors and the allocator's
#             blocks by the code that allocated them, in RUNS_DIR/zero3probe-probe/probe-PID.jsonl
#             (which buffer holds the 7B shape's second 14 GiB: docs/gpu-validation.md, row Z);
#   qlora     QLoRA: a 4-bit bitsandbytes base (Qwen2.5-1.5B shape) with LoRA adapters;
#   vl        a vision-language trial (Qwen2.5-VL-3B shape, 256 image tokens per prompt);
#   microbatch  step time against the micro-batch: scripts/gpu_microbatch.py (forward + backward
#             per micro-batch with and without checkpointing, generate per batch), then three TRL
#             trials at one global batch of 32 as 2 x 16, 8 x 4 and 32 x 1 (about 4 minutes);
#   phase     how much of a run's luck its generation and training phases share: 8 x 4 and 32 x 1
#             (the same generation each step) run PHASE_REPS times each (default 4), alternately
#             (8 x 4 first in odd repeats, 32 x 1 in even ones; the sixth lease ran 8 x 4 first always),
#             2 warm-up and up to 4 measured steps, read by scripts/phase_noise.py into RUNS_DIR/phase.md
#             (about 45 s a run on an H200; PH_MODEL, PH_LEN replace the model and completion length).
#
# PARTS (default "run zero3 qlora vl") picks and orders them; FLAGS are added to every search and
# RUN_MODEL, Z3_MODEL, QLORA_MODEL, VL_MODEL replace the models and RUN_SHORT, RUN_LONG the run
# part's two completion lengths (a CPU smoke run of the script:
# FLAGS="--device cpu" and tiny-qwen / tiny-qwen-vl); a part is skipped when less than its
# expected time is left before DEADLINE_S. Each trial's predicted peak (the memory model) and its
# measured peak (torch's reserved maximum and the device's used memory) go to RUNS_DIR/report.md;
# copy the rows to docs/gpu-validation.md. Needs torch with CUDA, transformers, trl, peft, deepspeed
# (DS_BUILD_OPS=0; cpu_adam is compiled in the background at the start) and bitsandbytes;
# scripts/gpu_wheels.sh fetches the ones a lent machine lacks, as wheels to carry.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs/gpu-checks}
DEADLINE=${2:-480}
PARTS=${PARTS:-run zero3 qlora vl}
START=$(date +%s)
mkdir -p "$RUNS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
AT=(python -m autotune)
read -r -a FLAGS <<<"${FLAGS:-}"
REPORT=$RUNS/report.md

# After each part: the report, and with OUT_DIR set, it and the small files (outcomes, params,
# metrics, NVML samples, checkpoints' trainer_state.json, logs' last 40 kB) as OUT_DIR/files.tgz.
collect() {
  python scripts/gpu_checks_report.py "$RUNS" >/dev/null 2>&1
  [ -n "${OUT_DIR:-}" ] || return 0
  cp "$RUNS/report.md" "$OUT_DIR/" 2>/dev/null
  find "$RUNS" -name stderr.log -o -name stdout.log | while read -r f; do tail -c 40000 "$f" >"$f.tail"; done
  (cd "$RUNS" && find . -size -4M \( -name outcome.json -o -name params.json -o -name metrics.jsonl \
    -o -name gpu.csv -o -name resumed_from.txt -o -name trainer_state.json -o -name '*.tail' \
    -o -name '*.txt' -o -name '*.yaml' -o -name '*.md' -o -name '*.json' -o -name 'probe-*.jsonl' \) \
    -not -path '*/model/*' \
    -print0 | tar czf "$OUT_DIR/files.tgz" --null -T -)
}

left() { echo $((DEADLINE - ($(date +%s) - START))); }
# A step's time limit: its own, cut to what is left before the deadline (less a margin for the
# report), so the deadline holds even when a step runs long and the last files still come back.
upto() { local cap=$(($(left) - 10)); echo $(($1 < cap ? $1 : (cap > 1 ? cap : 1))); }
log() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$RUNS/steps.txt"; }

# A one-point space: every knob pinned by its only choice, so a search runs exactly one trial.
space() {  # name bs ga G zero offload gc
  cat >"$RUNS/$1.yaml" <<EOF
version: 1
parameters:
  per_device_train_batch_size: {type: int, choices: [$2], default: $2}
  gradient_accumulation_steps: {type: int, choices: [$3], default: $3}
  num_generations: {type: int, choices: [$4], default: $4}
  zero_stage: {type: int, choices: [$5], default: $5}
  offload: {type: categorical, choices: [$6], default: $6}
  gradient_checkpointing: {type: bool, choices: [$7], default: $7}
  use_vllm: {type: bool, choices: [false], default: false}
EOF
}

one_trial() {  # name model prompt completion timeout extra-flags...
  local name=$1 model=$2 prompt=$3 completion=$4 limit=$5
  shift 5
  timeout "$(upto "$limit")" "${AT[@]}" search --model "$model" --gpus 1 --runner trl --space "$RUNS/$name.yaml" \
    --max-prompt-length "$prompt" --max-completion-length "$completion" --trials 1 --confirm 0 \
    --warmup-steps 1 --measure-steps 1 --trial-timeout 8m --hang-timeout 4m --name "$name" \
    --runs-dir "$RUNS" "${FLAGS[@]}" "$@" 2>&1 | tee "$RUNS/$name.txt" | tail -n 15
}

(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi") | tee "$RUNS/nvidia-smi.txt"
python - <<'PY' | tee "$RUNS/versions.txt"
import importlib
for name in ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes", "optuna"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001 - a missing package is a line in the report
        print(name, "MISSING", type(exc).__name__, exc)
PY
# DeepSpeed's cpu_adam (the offload optimizer) compiles on first use: minutes of CPU that the GPU
# parts before zero3 leave idle, so it is built beside them.
case " $PARTS " in *" zero3 "* | *" zero3probe "*)
  (python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    >"$RUNS/cpu_adam.txt" 2>&1; echo "exit $?" >>"$RUNS/cpu_adam.txt") & ;;
esac

for part in $PARTS; do
  case $part in
  run)
    # Completions of 128 tokens: batch 32 fits (35 GiB measured on an H100) and is exported. The
    # production run's completions grow to 1024 tokens: batch 32 then needs far more than the card
    # (at 640 it still squeezed in, at 79.5 of 79.6 GiB: docs/gpu-validation.md), a real CUDA OOM in
    # step 3, and the run resumes from checkpoint-2 on batch 16 x accumulation 2, the global batch
    # kept. About 7 minutes on an H100 (docs/gpu-validation.md, third lease: the step that dies
    # and its restart take about 4).
    [ "$(left)" -lt 480 ] && { log "skip run: $(left)s left"; continue; }
    log "run: search"
    cat >"$RUNS/run.yaml" <<EOF
version: 1
parameters:
  per_device_train_batch_size: {type: int, choices: [16, 32], default: 32}
  gradient_accumulation_steps: {type: int, choices: [1], default: 1}
  num_generations: {type: int, choices: [4], default: 4}
  zero_stage: {type: int, choices: [0], default: 0}
  offload: {type: categorical, choices: [none], default: none}
  gradient_checkpointing: {type: bool, choices: [false], default: false}
  use_vllm: {type: bool, choices: [false], default: false}
EOF
    timeout "$(upto 240)" "${AT[@]}" search --model "${RUN_MODEL:-Qwen2.5-1.5B}" --gpus 1 --runner trl --space "$RUNS/run.yaml" \
      --max-prompt-length 128 --max-completion-length "${RUN_SHORT:-128}" --trials 2 --confirm 0 --warmup-steps 1 \
      --measure-steps 1 --trial-timeout 4m --hang-timeout 3m --name run --runs-dir "$RUNS" "${FLAGS[@]}" \
      2>&1 | tee "$RUNS/run.txt" | tail -n 12
    # the production run is batch 32 whichever the two one-step trials ranked first
    python - "$RUNS/run" <<'PY'
import json, sys
from pathlib import Path
study = Path(sys.argv[1])
for trial in (study / "trials").iterdir():
    params = json.loads((trial / "params.json").read_text())
    if params["per_device_train_batch_size"] == 32:
        (study / "best" / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        print("best/params.json <- trial", trial.name)
PY
    log "run: 2 steps at ${RUN_SHORT:-128} tokens, a checkpoint each step"
    timeout "$(upto 150)" "${AT[@]}" run run --runs-dir "$RUNS" --steps 2 --save-steps 1 2>&1 | tee "$RUNS/run-1.txt" | tail -n 8
    log "run: 3 steps at ${RUN_LONG:-1024} tokens (resumes from checkpoint-2)"
    timeout "$(upto 300)" "${AT[@]}" run run --runs-dir "$RUNS" --steps 3 --save-steps 1 --max-completion-length "${RUN_LONG:-1024}" \
      2>&1 | tee "$RUNS/run-2.txt" | tail -n 12
    "${AT[@]}" show run --runs-dir "$RUNS" >"$RUNS/run-show.txt" 2>&1
    ;;
  zero3 | zero3probe)
    # zero3probe: the same trial under the tensor probe, one more measured step (three generations)
    need=150 limit=300 more=()
    [ "$part" = zero3probe ] && need=170 limit=330 more=(--measure-steps 2)
    [ "$(left)" -lt "$need" ] && { log "skip $part: $(left)s left"; continue; }
    log "$part: ${Z3_MODEL:-Qwen2.5-7B}, LoRA 16, ZeRO-3 optimizer+params offload"
    while ! grep -q '^exit' "$RUNS/cpu_adam.txt" 2>/dev/null && [ "$(left)" -gt "$need" ]; do sleep 2; done
    space "$part" 8 1 4 3 optimizer+params true
    (
      if [ "$part" = zero3probe ]; then
        export PYTHONPATH="$PWD/scripts/gpu_probe:$PYTHONPATH"
        export AUTOTUNE_TENSOR_PROBE="$(cd "$RUNS" && pwd)/zero3probe-probe"
      fi
      one_trial "$part" "${Z3_MODEL:-Qwen2.5-7B}" 128 64 "$limit" --lora-rank 16 "${more[@]}"
    )
    ;;
  qlora)
    [ "$(left)" -lt 80 ] && { log "skip qlora: $(left)s left"; continue; }
    log "qlora: Qwen2.5-1.5B, 4-bit NF4, LoRA 16"
    space qlora 16 1 4 0 none true
    one_trial qlora "${QLORA_MODEL:-Qwen2.5-1.5B}" 128 128 240 --lora-rank 16 --quantization 4bit
    ;;
  vl)
    [ "$(left)" -lt 70 ] && { log "skip vl: $(left)s left"; continue; }
    log "vl: Qwen2.5-VL-3B, 256 image tokens"
    space vl 8 1 4 0 none true
    one_trial vl "${VL_MODEL:-Qwen2.5-VL-3B}" 128 64 240 --image-tokens 256
    ;;
  microbatch)
    [ "$(left)" -lt 200 ] && { log "skip microbatch: $(left)s left"; continue; }
    log "microbatch: forward + backward and generate against the batch, ${MB_CARD:-qwen2.5-1.5b}"
    timeout "$(upto 150)" python scripts/gpu_microbatch.py --card "${MB_CARD:-qwen2.5-1.5b}" \
      --out "$RUNS/microbatch" 2>&1 | tee "$RUNS/microbatch.txt" | tail -n 25
    # generation batch 32 in all three (TRL generates bs x steps_per_generation at once); only the
    # training micro-batch changes
    for bs in 2 8 32; do
      [ "$(left)" -lt 60 ] && { log "skip mb$bs: $(left)s left"; continue; }
      space "mb$bs" "$bs" $((32 / bs)) 4 0 none false
      one_trial "mb$bs" "${MB_MODEL:-Qwen2.5-1.5B}" 128 128 120
    done
    ;;
  phase)
    for rep in $(seq "${PHASE_REPS:-4}"); do
      order="8 32"
      [ $((rep % 2)) = 0 ] && order="32 8"  # alternated, so neither always runs first
      for bs in $order; do
        [ "$(left)" -lt 60 ] && { log "skip ph$bs-$rep: $(left)s left"; continue; }
        log "phase: ${PH_MODEL:-Qwen2.5-1.5B} $bs x $((32 / bs)), run $rep"
        space "ph$bs-$rep" "$bs" $((32 / bs)) 4 0 none false
        one_trial "ph$bs-$rep" "${PH_MODEL:-Qwen2.5-1.5B}" 128 "${PH_LEN:-128}" 120 --warmup-steps 2 --measure-steps 4
      done
    done
    python scripts/phase_noise.py "$RUNS" >"$RUNS/phase.md" 2>&1
    cat "$RUNS/phase.md"
    ;;
  esac
  collect
done
log "done"
collect
cat "$RUNS/report.md"
