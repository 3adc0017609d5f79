#!/usr/bin/env bash
# Block by block at scale, on random-weight checkpoints of real shapes (eval.bench scale): a Llama-3.2-1B
# shape against its in-memory run, the planner's estimates, and the memory of the block-by-block pass on
# SmolLM2-135M. The weights are random: scores are meaningless, time and memory are real.
#
#   bash reports/scale/run.sh     # about 3 hours on 2 idle cores, 70 GB of disk
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/layercut-scale}
HERE=reports/scale
mkdir -p "$OUT" "$HERE/llama-3.2-1b" "$HERE/llama-3-8b"
# a 1B shape that fits: block by block against in memory, the fold (the default servable repair)
python -m eval.bench scale --shape llama-3.2-1b --drop 4 --in-memory --out "$OUT/1b"
cp "$OUT/1b/scale.json" "$OUT/1b/scale.md" "$HERE/llama-3.2-1b/"
rm -rf "$OUT/1b/slim" "$OUT/1b/slim-in-memory"  # 8 GB: the 8B run below needs the disk
# the 8B shape, larger than this machine's memory: written shard by shard, planned, then pruned block by
# block (about 2 h 15 min of these two cores)
python -m eval.bench scale --shape llama-3-8b --write-only --out "$OUT/8b"
python -m prune.run --model "$OUT/8b/llama-3-8b-float32" --offload sequential --drop 8 --data builtin --samples 32 \
    --seq-len 512 --plan --plan-json "$HERE/llama-3-8b/plan.json" | tee "$HERE/llama-3-8b/plan.txt"
python -m eval.bench scale --shape llama-3-8b --out "$OUT/8b"
cp "$OUT/8b/scale.json" "$OUT/8b/scale.md" "$HERE/llama-3-8b/"
# the block-by-block pass's memory on SmolLM2-135M at 32,768 tokens (a fresh process; base: the skeleton paged in)
python -m eval.bench scoring --methods sequential --tokens 32768 --time-tokens 8192 --repeats 3 --end-to-end 0 \
    --out "$OUT/scoring"
cp "$OUT/scoring/scoring.json" "$OUT/scoring/scoring.md" "$HERE/"
# prune.ship on the 1B shape, block by block then in memory (the tables of "fold-rotate and prune.ship block by
# block"; ship.json of the 187b61a runs in llama-3.2-1b/ship-187b61a/)
python -m eval.bench scale --shape llama-3.2-1b --write-only --out "$OUT/s1b"
# ship_1b COMMIT OFFLOAD...: the ship command of the tables, at the checked-out COMMIT, into llama-3.2-1b/ship-COMMIT/
ship_1b() {
  local commit=$1 off
  shift
  mkdir -p "$HERE/llama-3.2-1b/ship-$commit"
  for off in "$@"; do
    python -m prune.ship --model "$OUT/s1b/llama-3.2-1b-float32" --drop 4 --data builtin --samples 16 --seq-len 512 \
        --heldout-samples 2 --heal-steps 0 --engine transformers --no-verify --threads 2 --offload "$off" \
        --out "$OUT/s1b/ship-$commit-$off"
    cp "$OUT/s1b/ship-$commit-$off/ship.json" "$HERE/llama-3.2-1b/ship-$commit/$off.json"
  done
}
ship_1b 187b61a sequential none
# the same at b08fea3 (the skeleton's scoring pass keeps the measuring rows apart)
ship_1b b08fea3 sequential none
# the skeleton's again at b058062 (the shortlist planned again once its sets are known)
ship_1b b058062 sequential
# where the skeleton's peak is (1e66254 and the split of prune.selection.repaired): the same run in-process, a thread
# keeping the main thread's stack at each new high of VmRSS
cat > /tmp/peak.py <<'PY'
import json, sys, threading, time, traceback
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
highs, main = [], threading.main_thread()
def sample():
    best = 0
    while True:
        r = rss()
        if r > best * 1.005:
            best = r
            frame = sys._current_frames().get(main.ident)
            highs.append({"t": time.time(), "rss": r, "stack": traceback.format_stack(frame)[-14:] if frame else []})
        time.sleep(0.2)
threading.Thread(target=sample, daemon=True).start()
from prune.ship import main as ship
try:
    code = ship(sys.argv[1:])
finally:
    json.dump(highs, open(sys.argv[sys.argv.index("--out") + 1] + ".peaks.json", "w"))
sys.exit(code)
PY
/usr/bin/time -v python /tmp/peak.py --model /tmp/s1b/llama-3.2-1b-float32 --drop 4 --data builtin \
  --samples 16 --seq-len 512 --heldout-samples 2 --heal-steps 0 --engine transformers --no-verify --threads 2 \
  --offload sequential --out /tmp/p1b/seq
# the skeleton's peak after a2c31e5 (the measuring holds one vocabulary-wide batch, the heap trimmed after the fits and
# each measured view), then in memory, with the same sampler in one sitting
for off in none sequential; do
  /usr/bin/time -v python /tmp/peak.py --model /tmp/s1b/llama-3.2-1b-float32 --drop 4 --data builtin \
    --samples 16 --seq-len 512 --heldout-samples 2 --heal-steps 0 --engine transformers --no-verify --threads 2 \
    --offload "$off" --out "/tmp/p1b-2/$off"
  mkdir -p "$HERE/llama-3.2-1b/ship-5867be7"
  cp "/tmp/p1b-2/$off/ship.json" "$HERE/llama-3.2-1b/ship-5867be7/$off.json"
done
# prune.ship on the 8B shape block by block, training-free, verified at q4_k_m in llama.cpp (llama-3-8b/ship-28ac338/;
# 90 min of these two cores, 45 GB of disk beside the 32 GB shape; llama.cpp's extra buffer types were off there: see
# the README)
python -m eval.bench scale --shape llama-3-8b --write-only --out "$OUT/s8b"
python -m prune.ship --model "$OUT/s8b/llama-3-8b-float32" --offload sequential --drop 8 --data builtin --samples 32 \
    --seq-len 512 --heldout-samples 1 --heal-steps 0 --engine llamacpp --gguf-type q4_k_m --time-budget 3h \
    --threads 2 --repeats 0 --out "$OUT/s8b/ship"
mkdir -p "$HERE/llama-3-8b/ship-28ac338"
cp "$OUT/s8b/ship/ship.json" "$HERE/llama-3-8b/ship-28ac338/"
cp "$OUT/s8b/ship/README.md" "$HERE/llama-3-8b/ship-28ac338/card.md"
cp "$OUT/s8b/ship.work/shortlist.json" "$OUT/s8b/ship.work/verify.json" "$HERE/llama-3-8b/ship-28ac338/"
