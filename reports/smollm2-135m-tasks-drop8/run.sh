# Issue 17 at drop 8 on this CPU (2 cores): the command of ../smollm2-135m-tasks-gpu/run.sh with --drop 8,
# run from the repository root with ../shared/data beside it. linearpatch was listed last and stopped
# before it ran (Ctrl-C after layercut-linear-distill was recorded): the session's CPU time went to the
# "before" runs instead. Rerunning the same command resumes and adds it.
D=../shared/data
python -m eval.compare --drop 8 \
  --methods recipes/repairs/remove.yaml,layercut-linear,recipes/repairs/fold.yaml,layercut-linear-distill,linearpatch \
  --heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt \
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000 --data-dir $D \
  --out reports/smollm2-135m-tasks-drop8
