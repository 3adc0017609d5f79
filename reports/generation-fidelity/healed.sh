# Generation fidelity (eval.compare --metrics fidelity) of the healed recipes on SmolLM2-135M at drops 8 and 4,
# beside the training-free peers closest to them, with the per-prompt rows for paired gaps (2026-12-06, after
# 66e02fd). The same calibration, held-out texts and prompts as run.sh (the grid's; its kept self-text sample copied
# into the cache), on this 2-core CPU, float32, one run at a time. Run from the repository root with ../shared/data
# beside it. No tasks: the grid (reports/smollm2-135m-grid) scored them with the same recipes and seeds.
. reports/generation-fidelity/settings.sh  # calibration, held-out texts, the grids' samples
# in the order they ran, about 15 minutes a healed cell
DROP8=layercut-local-heal,linearpatch-distill,gromov-heal  # the training-free rows: run.sh (per-prompt rows)
DROP4=layercut-local-heal,linearpatch-distill  # the training-free rows: run.sh (means only at drop 4)

for drop in 8 4; do
  methods=DROP$drop
  python -m eval.compare --model smollm2-135m --drop $drop $COMMON --methods ${!methods} \
    --out /tmp/smollm2-135m-fidelity-healed-$drop
  folder=reports/generation-fidelity/smollm2-135m-healed-drop$drop
  mkdir -p $folder && cp /tmp/smollm2-135m-fidelity-healed-$drop/{README.md,results.json} $folder/
done

# the paired gaps the README quotes, against layercut-local-heal (the training-free rows at drop 8: run.sh's second run)
F=reports/generation-fidelity
python -m eval.lab paired-fidelity $F/smollm2-135m-healed-drop8/results.json::layercut-local-heal@8 \
  $F/smollm2-135m-healed-drop8/results.json::{linearpatch-distill,gromov-heal}@8 \
  $F/smollm2-135m-drop8-rows/results.json::{layercut-linear,linearpatch,llm-streamline,layercut-local}@8 \
  $F/smollm2-135m-healed-drop8/results.json::dense
python -m eval.lab paired-fidelity $F/smollm2-135m-healed-drop4/results.json::layercut-local-heal@4 \
  $F/smollm2-135m-healed-drop4/results.json::linearpatch-distill@4 \
  $F/smollm2-135m-healed-drop4/results.json::dense
