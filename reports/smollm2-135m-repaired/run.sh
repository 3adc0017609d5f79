# Blocks chosen for their repair (issue "Choose blocks for their repair"), SmolLM2-135M on the CPU. Run from the
# repository root with ../shared/data beside it; the same command resumes (cells already in results.json with the
# same recipe digest are not run again). Four domains of 4,096 held-out tokens; four tasks on 200 rows drawn at
# random from all but each task's last 500 (the selection split's task prompts); the default calibration
# (32 x 512 tokens, half the built-in novel, half text sampled from the model).
D=../shared/data
SHARED="--heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt
  --heldout-tokens 4096 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 200~:-500 --data-dir $D --threads 2
  --speed-tokens 0 --out reports/smollm2-135m-repaired"
# 1. removal and layercut's map on the linearity top-k (the draw's rows), against the repaired-greedy selection
#    with the map and with the fold (its vanilla twin); the oracle with its repaired column.
python -m eval.compare --drop 4,8 --methods recipes/repairs/remove.yaml,layercut-linear,layercut-best,layercut-best-vanilla \
  --oracle $SHARED
