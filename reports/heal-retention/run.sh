# Retention against heal minutes (2026-12-04, 2-core CPU, float32, SmolLM2-135M at drop 8, one job at a time). Run
# from the repository root with ../shared/data beside it.
set -e
D=../shared/data
# 1. the build: the README's one command (as in reports/ship-defaults, "A newcomer from a fresh clone", at bf55546),
#    which keeps the checkpoint as built and its calibration rows in slim8.work/
python -m prune.ship --model smollm2-135m --drop 8 --engine llamacpp --gguf-type q4_k_m --out /tmp/newcomer/slim8/
# 2. ship's heal at 0, 100, 200 and 400 steps on that build (each from the start, with its own schedule), each scored
#    on the four held-out domains and on 400 drawn rows of four tasks (the grids' rows), the original once
uptime
python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/newcomer/slim8.work/checkpoint \
  --calibration /tmp/newcomer/slim8.work/calibration.safetensors --steps 0,100,200,400 \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 400~:-500 --data-dir $D --threads 2 --out reports/heal-retention/drop8
uptime
# 3. that run was at 7e56038; a review's mend (dd4e822) and the plot's labels after it changed only how the task figures are
#    summed up, written and drawn, so the folder was written again from the run's JSON (the measured figures as run)
python - <<'PY'
import json
from eval.bench.heal_curve import heal_curve_markdown, plot_heal_curve, task_summary
from eval.bench.output import report_results
out = "reports/heal-retention/drop8"
results = json.load(open(f"{out}/heal_curve.json"))
for point in results["points"]:
    point.pop("quality", None)
tasks = results["tasks"]
results["tasks"] = {"names": tasks["names"], "limit": tasks["limit"],
                    **task_summary(results["points"], results["original"], tasks["names"])}
report_results(out, "heal_curve", results, heal_curve_markdown(results), plot_heal_curve)
PY
# 4. (2026-12-04, evening) the same build healed 400 steps with WikiText-2 beside the calibration, the same scoring;
#    then its paired gaps to the points of step 2 above
uptime
python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/newcomer/slim8.work/checkpoint \
  --calibration /tmp/newcomer/slim8.work/calibration.safetensors --steps 400 \
  --heal-data $D/wikitext-2-train-prefix/wikitext2_train_first1MB.txt --heal-samples 256 \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 400~:-500 --data-dir $D --threads 2 --out reports/heal-retention/drop8-wikitext
uptime
python - > reports/heal-retention/drop8-wikitext/compared.txt <<'PY'
# the 400-step heal with WikiText-2 beside the calibration, paired row by row with the curve of drop8/
import json

from eval.compare.stats import gap_stderr, retention_tasks, task_figures

WIKI = "+ WikiText-2 train, 400 steps"
old = json.load(open("reports/heal-retention/drop8/heal_curve.json"))
new = json.load(open("reports/heal-retention/drop8-wikitext/heal_curve.json"))
names = old["tasks"]["names"]
# the same rows of the same tasks: the original's answers must be the same, row by row, or nothing pairs
assert old["original"]["task_rows"] == new["original"]["task_rows"], "the original's rows differ"
counted, _ = retention_tasks(old["original"], names)
points = {f"calibration, {point['steps']} steps": point for point in old["points"]}
points[WIKI] = new["points"][0]
figures = {name: task_figures(point, names, counted, old["original"]) for name, point in points.items()}
for other in ("calibration, 0 steps", "calibration, 400 steps"):
    gap = figures[WIKI]["retention"] - figures[other]["retention"]
    stderr = gap_stderr(points[WIKI], points[other], figures[WIKI], figures[other], "retention", counted,
                        old["original"])
    print(f"WikiText 400 vs {other}: {100 * gap:+.1f} ± {100 * stderr:.1f} points")
for name, point in points.items():
    print(name, "retention", round(100 * figures[name]["retention"], 1), "minutes", point["minutes"], "geo",
          round(point["heldout_ppl"], 3), point["kl"])
PY
