#!/usr/bin/env bash
# Distillation on one process against two (accelerate's data parallel engine over gloo, then FSDP2), and a
# checkpoint of the two processes resumed on one: SmolLM2-135M at drop 4 with linear maps, on the CPU.
#
#   bash reports/smollm2-135m-processes/run.sh     # about 10 minutes on 2 idle cores
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/layercut-processes}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1  # one thread per process: the two processes share the two cores
STEPS=10
python -m prune.run --model smollm2-135m --drop 4 --replace linear --data builtin --out "$OUT/student" --overwrite
COMMON=(--student "$OUT/student" --teacher smollm2-135m --steps $STEPS --batch-size 2 --seq-len 128 --data builtin
        --samples 128 --heldout-samples 0 --train all --log-every 1 --overwrite)
TWO=(python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no
     --dynamo_backend no -m distill.run)
python -m distill.run "${COMMON[@]}" --grad-accum 2 --out "$OUT/one"
"${TWO[@]}" "${COMMON[@]}" --grad-accum 1 --out "$OUT/two" --work-dir "$OUT/two.work" --save-every 5 \
    --save-total-limit 2 --keep-checkpoints
LAYERCUT_CPU_FSDP=1 "${TWO[@]}" "${COMMON[@]}" --grad-accum 1 --out "$OUT/fsdp"
# the two processes' checkpoint at step 5, resumed on one process with twice the accumulation
rm "$OUT/two.work/checkpoints/step-$(printf %08d $STEPS).pt"
python -m distill.run "${COMMON[@]}" --grad-accum 2 --out "$OUT/resumed" --work-dir "$OUT/two.work" --resume

curve() { jq -s '[.[] | {step, loss, grad_norm}]' "$OUT/$1/train_log.jsonl"; }
jq -n --argjson one "$(curve one)" --argjson two "$(curve two)" --argjson fsdp "$(curve fsdp)" \
    --argjson resumed "$(curve resumed)" '
  def gap(a; b): [range(0; a | length) as $i | ((b[$i].loss - a[$i].loss) / a[$i].loss | fabs)] | max;
  {steps: ($one | length),
   runs: {"1 process, --grad-accum 2": $one, "2 processes (DDP over gloo), --grad-accum 1": $two,
          "2 processes (FSDP2 over gloo), --grad-accum 1": $fsdp,
          "2 processes to step 5, resumed on 1 with --grad-accum 2": $resumed},
   largest_relative_loss_gap_to_1_process: {ddp: gap($one; $two), fsdp: gap($one; $fsdp),
                                            resumed: gap($one; $resumed)}}' > reports/smollm2-135m-processes/results.json
cat reports/smollm2-135m-processes/results.json | jq '.largest_relative_loss_gap_to_1_process'
