# Issue 17's "before" on this CPU (2 cores), from the repository root with ../shared/data beside it:
# the defaults as they were (calibration: the shipped novel alone; the linear map fitted on long sequences
# only), the same held-out texts and tasks as ../smollm2-135m-tasks-gpu and ../smollm2-135m-tasks-drop8.
D=../shared/data
HELDOUT=novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt
# 1. every cell, perplexity on the four domains (7.4 minutes)
python -m eval.compare --samples 32 --data builtin --drop 4,8 \
  --methods recipes/repairs/remove.yaml,recipes/repairs/linear-long.yaml,recipes/repairs/fold.yaml \
  --heldout $HELDOUT --heldout-tokens 8192 --keep-checkpoints --speed-tokens 0 --out reports/smollm2-135m-tasks-before
# 2. the tasks of the dense model and of the map that changed, on the kept weights
python -m eval.compare --samples 32 --data builtin --drop 4,8 --methods recipes/repairs/linear-long.yaml \
  --heldout $HELDOUT --heldout-tokens 8192 --keep-checkpoints --speed-tokens 0 \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000 --data-dir $D --out reports/smollm2-135m-tasks-before
# 3. the isolation row: layercut-linear as it is now (--fit-short 64) on the old calibration, drop 4
python -m eval.compare --samples 32 --data builtin --drop 4 --methods layercut-linear \
  --heldout $HELDOUT --heldout-tokens 8192 --keep-checkpoints --speed-tokens 0 \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000 --data-dir $D --out reports/smollm2-135m-tasks-before
# 4. fold's tasks, on its kept weights
python -m eval.compare --samples 32 --data builtin --drop 4,8 --methods recipes/repairs/fold.yaml \
  --heldout $HELDOUT --heldout-tokens 8192 --keep-checkpoints --speed-tokens 0 \
  --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000 --data-dir $D --out reports/smollm2-135m-tasks-before
