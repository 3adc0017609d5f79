# Issue 17 at drop 8 on this CPU (2 cores): the command of ../smollm2-135m-tasks-gpu/run.sh with --drop 8 and the
# 2,000-step distillation recipe, run from the repository root with ../shared/data beside it. The same command
# resumes: cells already in results.json (same recipe digest) are not run again. linearpatch is listed last and
# was stopped each time before its tasks (SIGTERM once the cell before it was recorded): the CPU time went elsewhere.
D=../shared/data
SHARED="--heldout novel=$D/austen/sensesensibility.txt,news=$D/ptb/ptb.test.txt,wiki=$D/wikitext-2-raw-v1/test.jsonl,plays=$D/tinyshakespeare/input.txt
  --heldout-tokens 8192 --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 1000 --data-dir $D --threads 2
  --out reports/smollm2-135m-tasks-drop8"
python -m eval.compare --samples 32 --drop 8 \
  --methods recipes/repairs/remove.yaml,layercut-linear,recipes/repairs/fold.yaml,layercut-linear-distill,recipes/repairs/linear-distill-2000.yaml,recipes/repairs/linear-distill-mixed.yaml,linearpatch \
  $SHARED
# Drop 4 on this CPU, in the same --out so the dense row and its task answers are shared (commit f7f1293): the 200-step
# distillation as it is now, on the default mixture (recipes/repairs/linear-distill-mixed.yaml's text), and removal.
python -m eval.compare --samples 32 --drop 4 --methods layercut-linear-distill,recipes/repairs/remove.yaml $SHARED
# Commit 610414f: the distillation objective, KL on the logits (recipes/repairs/linear-distill-kl.yaml), at both drops.
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/linear-distill-kl.yaml $SHARED
# Commit 06f55c4: KL with LoRA (rank 8) on the kept blocks as well as the maps (recipes/repairs/linear-distill-kl-lora.yaml),
# best on the selection split (1.744x dense against 1.832x for the maps alone), at both drops.
python -m eval.compare --samples 32 --drop 4,8 --methods recipes/repairs/linear-distill-kl-lora.yaml $SHARED
# Commit e34e75a: five times the steps (1,000) of the 06f55c4 recipe at drop 4, nothing else changed.
python -m eval.compare --samples 32 --drop 4 --methods recipes/repairs/linear-distill-kl-lora-1000.yaml $SHARED
# Commit 4ba9ef9: linearpatch at drop 8 alone (listed in the first command, it was stopped before its tasks twice).
python -m eval.compare --samples 32 --drop 8 --methods linearpatch $SHARED
