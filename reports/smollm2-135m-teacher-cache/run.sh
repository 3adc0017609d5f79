#!/usr/bin/env bash
# Distillation from the teacher's top-K logits cached once (--teacher-cache) against online distillation:
# SmolLM2-135M at drop 4 (linear maps), 100 steps of 4 x 128 tokens, the same data, seed and batch; each run
# in its own process (peak RSS), the final KL with the full softmax on 32 held-out sequences.
#
#   bash reports/smollm2-135m-teacher-cache/run.sh     # about 15 minutes on 2 idle cores
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/layercut-teacher-cache}
python -m eval.bench teacher-cache --model smollm2-135m --drop 4 --steps 100 --batch-size 4 --work "$OUT/work" \
    --out "$OUT/out"
cp "$OUT/out/teacher_cache.json" reports/smollm2-135m-teacher-cache/results.json
