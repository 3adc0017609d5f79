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
